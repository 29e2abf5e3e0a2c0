"""The whole flow through a real window on the real engine and the bundled demo model:
demo model, demo data (rows, rendered example, packing), Train with a short config, live
plots, Pause (no step advances), Resume, Stop (checkpoint), export (adapter + merged) and load
the adapter with PEFT, chat with the result; the engine's events all come from the worker thread."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from studio_helpers import EventRecorder, screenshot, short_config

pytestmark = pytest.mark.slow


def test_model_data_train_pause_resume_stop_export_chat(window, qtbot, runs_dir, tmp_path):
    from studio.main_window import CHAT, DATA, EXPORT, MONITOR, TRAIN

    # -- Data: rows, example with its mask, packing -------------------------------------------
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    assert dp.rows_model.rowCount() > 0 and dp.rows_model.columnCount() >= 2
    qtbot.waitUntil(lambda: dp.mask_view.num_tokens > 0, timeout=60_000)
    assert 0 < dp.mask_view.num_trained < dp.mask_view.num_tokens
    qtbot.waitUntil(lambda: dp.packing_view.num_rows > 0, timeout=60_000)
    assert "efficiency" in dp.packing_stats.text()
    window.go_to(DATA)
    for tab, name in ((0, "data-rows"), (1, "data-example"), (2, "data-packing")):
        dp.tabs.setCurrentIndex(tab)
        screenshot(window, name)
    dp.tabs.setCurrentIndex(0)

    # -- Train: a short run, its events recorded as the worker emits them ----------------------
    short_config(window.state, runs_dir, "flow", steps=400)
    window.go_to(TRAIN)
    assert window.training_panel.train.isEnabled()
    # The window imports the engine's heavy modules in the background after it opens, so the
    # run below does not pay for them on its worker thread.
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    qtbot.mouseClick(window.training_panel.train, Qt.MouseButton.LeftButton)
    assert window.is_training()
    events = EventRecorder(window.worker)
    assert window.pages.currentIndex() == MONITOR
    m = window.monitor_panel
    qtbot.waitUntil(lambda: m.loss.point_count() >= 3, timeout=120_000)
    m.refresh()
    assert m.lr.point_count() >= 3 and m.memory.point_count() >= 3 and m.tps.point_count() >= 3
    # The packing counters: metadata built once per micro-batch (one per step here). The only
    # host reads are the CPU reference attention's (one per layer call, counted as syncs),
    # which a GPU does not make; tests/engine/fastpath/test_fastpath_counters.py sniffs for any other.
    last = m.last_metrics
    assert last.host_syncs == last.fast_path_calls.get("attention:reference", 0) > 0
    assert f"packing meta 1×, {last.host_syncs} syncs" in m.eta.text()
    assert m.fast_path_warning == ""  # every fast path the run asked for ran

    # Pause: once the engine says it paused, no step runs until it says it resumed.
    qtbot.mouseClick(m.pause, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: m.mode == "paused", timeout=60_000)
    paused_at = m.last_step
    assert m.resume.isEnabled() and not m.pause.isEnabled()

    # Resume: steps advance again.
    qtbot.mouseClick(m.resume, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: m.last_step >= paused_at + 2, timeout=60_000)
    between = events.between("Paused", "Resumed")
    assert "StepMetrics" not in between, f"a step ran while paused: {between}"

    # Stop: the run ends early with a checkpoint.
    with qtbot.waitSignal(window.run_finished, timeout=120_000) as done:
        qtbot.mouseClick(m.stop, Qt.MouseButton.LeftButton)
    event = done.args[0]
    assert type(event).__name__ == "Finished" and event.stopped, event
    run_dir = Path(event.run_dir)
    assert run_dir == runs_dir / "flow"
    assert any((run_dir / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
    assert not window.is_training()
    assert "Stopped" in m.status.text()
    # A step on the GUI thread would freeze the window for its length; every event came from the worker.
    assert "StepMetrics" in events.names and events.on_gui_thread == [], events.on_gui_thread
    m.refresh()
    screenshot(window, "monitor")

    # -- Export: the adapter and a merged model ----------------------------------------------
    window.go_to(EXPORT)
    ep = window.export_panel
    assert ep.select_source(str(run_dir))
    out = tmp_path / "exported"
    ep.dest.setText(str(out))
    ep.want_adapter.setChecked(True)
    ep.want_merged.setChecked(True)
    with qtbot.waitSignal(ep.exported, timeout=180_000) as exported:
        qtbot.mouseClick(ep.export_button, Qt.MouseButton.LeftButton)
    written = exported.args[0]
    assert "adapter_model.safetensors" in written[str(out / "adapter")]
    assert any(f.endswith(".safetensors") for f in written[str(out / "merged")])
    assert "adapter_model.safetensors" in ep.result.toPlainText()
    screenshot(window, "export")

    # The exported adapter loads with PEFT onto the demo base, and it learned something.
    import torch
    from peft import PeftModel

    from engine.config import ModelConfig
    from engine.models.loading import load_model

    base = load_model(ModelConfig(name_or_path="demo"), "cpu", "float32")
    tuned = PeftModel.from_pretrained(base, str(out / "adapter"))
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().sum()) > 0 for p in lora_b)
    del tuned, base
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32)
    assert merged.config.model_type == "llama"
    del merged

    # -- Chat: base vs fine-tuned ------------------------------------------------------------
    window.go_to(CHAT)
    cp = window.chat_panel
    assert cp.source.count() > 0
    cp.prompt.setPlainText("What is 2 plus 3?")
    cp.max_tokens.setValue(8)
    with qtbot.waitSignal(cp.replied, timeout=180_000) as replied:
        qtbot.mouseClick(cp.send, Qt.MouseButton.LeftButton)
    result = replied.args[0]
    assert isinstance(result["tuned"], str) and isinstance(result["base"], str)
    assert cp.tuned.toPlainText() == result["tuned"]
