"""The Export page lists the engine's export registry, runs the engine's one export flow with its
self-check, and shows each artefact's verdict: a fake run (its adapter cannot load, so its check
fails and nothing is written), a trained run (verified, and for a GGUF the `ollama create`
command with a copy button), and a run in progress shown as "running", not "incomplete"."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
from PySide6.QtCore import Qt


def _fake_run(runs_dir):
    run = runs_dir / "fake-run"
    adapter = run / "adapter"
    adapter.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name_or_path: demo\n")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    header = json.dumps({"q_proj.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return run


def _trained_run(runs_dir: Path, name: str = "trained", steps: int = 12) -> Path:
    """A short demo run, trained through the engine (the page's job starts after training)."""
    from engine.api import DEMO_PRESET, Finished, RunConfig, TrainingSession

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.training.max_steps = steps
    cfg.training.rows_per_micro_batch = 1
    cfg.training.warmup_steps = 2
    cfg.training.save_every = 0
    cfg.data.max_seq_len = 128
    cfg.output.dir = str(runs_dir)
    cfg.output.run_name = name
    result = TrainingSession(cfg, lambda e: None).run()
    assert isinstance(result, Finished), getattr(result, "message", result)
    return runs_dir / name


def test_export_page_runs_the_registry_and_shows_a_failed_check(window, qtbot, runs_dir, tmp_path):
    from engine.api import EXPORTERS
    from studio.main_window import EXPORT

    ep = window.export_panel
    assert list(ep.wants) == list(EXPORTERS)  # one checkbox per registered kind
    assert ep.want_adapter.isChecked() and not ep.want_merged.isChecked()

    run = _fake_run(runs_dir)
    window.go_to(EXPORT)
    ep.refresh()
    assert ep.select_source(str(run))
    for box in ep.wants.values():
        box.setChecked(False)
    ep.dest.setText(str(tmp_path / "out"))
    ep.start_export()
    assert ep.banner.text() == "Tick at least one of: the adapter, the merged model, the GGUF."

    ep.want_adapter.setChecked(True)
    outcome: list[tuple[str, object]] = []
    ep.failed.connect(lambda msg: outcome.append(("failed", msg)))
    ep.exported.connect(lambda written: outcome.append(("exported", written)))
    qtbot.mouseClick(ep.export_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(outcome), timeout=300_000)
    kind, message = outcome[0]
    assert kind == "failed" and "failed its self-check" in message, outcome
    verdicts = ep.verdict_texts()
    assert verdicts["adapter"].startswith("failed: the self-check could not run")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    assert ep.export_button.isEnabled() and "Export failed" in ep.banner.text()
    # The verdict is in the run folder, and the page shows it again when the run is picked.
    assert json.loads((run / "export-report.json").read_text())["exports"]["adapter"]["status"] == "failed"
    ep.verdicts.clear()
    ep.refresh(select=str(run))
    assert ep.verdict_texts()["adapter"].startswith("failed:")


@pytest.mark.slow
def test_export_page_shows_the_verdicts_of_a_trained_run(window, qtbot, runs_dir, tmp_path):
    from studio_helpers import screenshot

    from engine.api import gguf_missing
    from studio.main_window import EXPORT

    run = _trained_run(runs_dir)
    ep = window.export_panel
    window.go_to(EXPORT)
    ep.refresh(select=str(run))
    out = tmp_path / "exported"
    ep.dest.setText(str(out))
    ep.want_adapter.setChecked(True)
    ep.want_merged.setChecked(True)
    gguf = not gguf_missing()
    assert ep.want_gguf.isEnabled() == gguf and ep.rows["gguf"].install.isVisibleTo(ep) != gguf
    if gguf:
        ep.want_gguf.setChecked(True)
        ep.rows["gguf"].options["quant"].setCurrentText("q8_0")
    with qtbot.waitSignal(ep.exported, timeout=600_000) as exported:
        qtbot.mouseClick(ep.export_button, Qt.MouseButton.LeftButton)
    written = exported.args[0]
    assert "adapter_model.safetensors" in written[str(out / "adapter")]
    verdicts = ep.verdict_texts()
    assert verdicts["adapter"] == "verified: behaves like the trained model"
    assert verdicts["merged"].startswith("verified")
    if gguf:
        assert verdicts["gguf"].startswith("verified"), verdicts["gguf"]
        assert ep.next_command.text() == f'ollama create trained-q8_0 -f "{out / "gguf" / "Modelfile"}"'
        qtbot.mouseClick(ep.copy_button, Qt.MouseButton.LeftButton)
        from PySide6.QtWidgets import QApplication

        assert QApplication.clipboard().text() == ep.next_command.text()
    screenshot(window, "export-verdicts")


def test_a_run_in_progress_shows_as_running(window, qtbot, runs_dir):
    from studio.main_window import EXPORT

    run = runs_dir / "live"
    (run / "checkpoints" / "step-2" / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name_or_path: demo\n")
    (run / "metrics.jsonl").write_text(json.dumps({"event": "RunStarted", "run_dir": str(run)}) + "\n")
    ep = window.export_panel
    window.go_to(EXPORT)

    def status() -> str:
        ep.refresh()
        for i in range(ep.tree.topLevelItemCount()):
            if ep.tree.topLevelItem(i).text(0) == "live":
                return ep.tree.topLevelItem(i).text(1)
        return ""

    assert status() == "running"  # metrics written just now
    old = time.time() - 3600
    os.utime(run / "metrics.jsonl", (old, old))
    assert status() == "incomplete"  # no outcome and nothing written for an hour: it ended
    window.state.run_dir_changed.emit(str(run))  # the run this window is training
    assert status() == "running"
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "Finished", "stopped": False}) + "\n")
    assert status() == "finished"


def test_the_install_button_shows_only_when_the_gguf_extra_is_missing(window):
    from engine.api import gguf_missing

    ep = window.export_panel
    missing = bool(gguf_missing())
    assert ep.rows["gguf"].install.isVisibleTo(ep) == missing
    assert ep.want_gguf.isEnabled() != missing
    installed = importlib.util.find_spec("llama_cpp") is not None
    assert missing or installed
