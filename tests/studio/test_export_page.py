"""The Export page lists the engine's export registry and runs the engine's one export flow:
a fake run (no model is loaded) exported through the page, and the page's refusals."""

from __future__ import annotations

import json

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


def test_export_page_runs_the_registry(window, qtbot, runs_dir, tmp_path):
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
    assert ep.banner.text() == "Tick the adapter, the merged model, or both."

    ep.want_adapter.setChecked(True)
    with qtbot.waitSignal(ep.exported, timeout=60_000) as exported:
        qtbot.mouseClick(ep.export_button, Qt.MouseButton.LeftButton)
    assert exported.args[0] == {str(tmp_path / "out"): ["adapter_config.json", "adapter_model.safetensors"]}
    assert (run / "exports" / "adapter.json").is_file()

    # The same folder again: refused by the engine, shown on the page, nothing overwritten.
    with qtbot.waitSignal(ep.failed, timeout=60_000) as failed:
        qtbot.mouseClick(ep.export_button, Qt.MouseButton.LeftButton)
    assert "already exists and is not empty" in failed.args[0]
    assert ep.export_button.isEnabled()
