"""The Train page: engine validation shown under the field it names, presets that keep the
chosen model and data, automatic values marked, and the resolved config saved and loaded."""

from __future__ import annotations

import yaml
from studio_helpers import screenshot


def _type(qtbot, editor, text):
    editor.selectAll()
    editor.clear()
    qtbot.keyClicks(editor, text)


def test_bad_values_show_the_engine_message_next_to_the_field(window, qtbot):
    from studio.main_window import TRAIN

    window.go_to(TRAIN)
    page = window.training_panel
    lr = page.form.fields["training.lr"].editor
    _type(qtbot, lr, "fast")
    assert "expected a number" in page.form.error_text("training.lr")
    assert not page.train.isEnabled()
    _type(qtbot, lr, "1e-4")
    assert page.form.error_text("training.lr") == ""
    assert window.state.get("training.lr") == 1e-4
    assert page.train.isEnabled()

    r = page.form.fields["lora.r"].editor
    _type(qtbot, r, "0")
    assert "must be > 0" in page.form.error_text("lora.r")
    assert not page.train.isEnabled()
    _type(qtbot, r, "8")
    assert page.train.isEnabled()
    assert page.form.fields["training.lr"].editor.toolTip()  # every field explains itself


def test_presets_keep_model_and_data_and_auto_values_are_marked(window, qtbot, tmp_path):
    from studio.main_window import TRAIN

    page = window.training_panel
    names = [page.preset.itemText(i) for i in range(page.preset.count())]
    assert {"demo", "laptop-qlora", "quality"} <= set(names)
    window.state.set("data.source", str(tmp_path / "mine.jsonl"))
    page.apply_preset("quality")
    assert window.state.get("lora.r") == 64
    assert window.state.get("data.source") == str(tmp_path / "mine.jsonl")
    assert window.state.get("model.name_or_path") == "demo"
    page.apply_preset("demo")
    window.state.set("data.source", "demo")

    qtbot.waitUntil(lambda: window.state.profile is not None, timeout=60_000)
    page.validate()
    badge = page.form.fields["training.device"].badge
    assert badge.isVisibleTo(page) and ("cpu" in badge.text() or "cuda" in badge.text())
    assert "training.device" in page.auto_text.toPlainText()
    window.go_to(TRAIN)
    screenshot(window, "train")

    path = tmp_path / "run.yaml"
    saved = page.save_config(path)
    data = yaml.safe_load(path.read_text())
    assert "training.device" in data["auto_fields"]
    assert data["training"]["device"] in ("cpu", "cuda")
    window.state.set("lora.r", 4)
    page.load_config(path)
    assert window.state.get("lora.r") == saved.lora.r
    assert window.state.get("training.device") == "auto"  # automatic again on this machine
