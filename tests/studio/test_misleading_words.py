"""Words the window shows that said something other than what is true (issue 28 item 10): each test
checks the state a user reads (which column holds what, which field is in charge, what a disabled
button looks like), not the exact English."""

from __future__ import annotations

from PySide6.QtCore import Qt


def test_xray_row_column_holds_row_numbers_only(qtbot):
    from engine.data.xray import Finding, XRay
    from studio.widgets.data_xray import DataXRay

    view = DataXRay()
    qtbot.addWidget(view)
    x = XRay(rows=40, max_seq_len=64, lengths=[10] * 40)
    x.findings = [Finding("duplicate", r, f"same as row {r - 1}") for r in (5, 9, 30)]
    total = view.set_xray(x, {"duplicate": "duplicate rows"})
    assert total == 3
    group = view.tree.topLevelItem(0)
    assert group.data(0, Qt.ItemDataRole.UserRole) == "duplicate"
    assert group.text(1) == ""  # a group is not a row: its count stays out of the Row column
    assert "3" in group.text(0)  # the count goes with the sentence
    # Indices 5, 9 and 30, read from 1.
    assert [group.child(i).text(1) for i in range(group.childCount())] == ["6", "10", "31"]


def _train_page(qtbot, settings, runs_dir):
    from studio.panels.training import TrainingPanel
    from studio.state import StudioState

    page = TrainingPanel(StudioState(str(runs_dir)), settings)
    qtbot.addWidget(page)
    return page


def test_train_page_labels_are_words_with_the_key_in_the_tooltip(qtbot, settings, runs_dir):
    from PySide6.QtWidgets import QLabel

    page = _train_page(qtbot, settings, runs_dir)
    labels = {w.toolTip().split("</b>")[0].removeprefix("<b>"): w.text() for w in page.form.findChildren(QLabel)}
    for key, raw in (("training.lr", "lr"), ("fast_paths.ce_chunk_tokens", "ce chunk tokens"), ("lora.r", "r")):
        assert key in labels, key  # the config key is still there, in the tooltip
        assert labels[key] != raw and len(labels[key]) > len(raw)


def test_one_place_to_type_the_gallery_prompts(qtbot, settings, runs_dir):
    from PySide6.QtWidgets import QLineEdit

    page = _train_page(qtbot, settings, runs_dir)
    assert "training.gallery_prompts" not in page.form.fields
    copies = [w for w in page.form.findChildren(QLineEdit) if "gallery_prompts" in w.toolTip()]
    assert copies == []  # no second, read-only copy in the form
    page.gallery_prompts.setPlainText("What is 2 plus 2?\nName a colour, please.")
    assert page.state.get("training.gallery_prompts") == ["What is 2 plus 2?", "Name a colour, please."]


def test_max_steps_wins_over_epochs_and_the_epochs_field_says_so(qtbot, settings, runs_dir):
    page = _train_page(qtbot, settings, runs_dir)
    epochs = page.form.fields["training.epochs"]
    page.state.set("training.max_steps", 40)
    page.validate()
    assert not epochs.editor.isEnabled() and epochs.badge.isVisibleTo(page.form)
    assert "40" in epochs.badge.text()
    page.state.set("training.max_steps", 0)
    page.validate()
    assert epochs.editor.isEnabled() and not epochs.badge.isVisibleTo(page.form)


def test_a_disabled_primary_button_looks_disabled(qtbot):
    """The stylesheet's disabled primary button is grey, as every disabled button is, not a paler
    blue with white text that reads as pressable (measured on the rendered pixels)."""
    from PySide6.QtWidgets import QHBoxLayout, QPushButton, QWidget

    from studio.app import load_style

    host = QWidget()
    qtbot.addWidget(host)
    host.setStyleSheet(load_style())
    lay = QHBoxLayout(host)
    buttons = {}
    for name, enabled in (("on", True), ("off", False)):
        b = QPushButton("Train")
        b.setObjectName("primary")
        b.setEnabled(enabled)
        b.setMinimumSize(120, 32)
        lay.addWidget(b)
        buttons[name] = b
    host.show()
    qtbot.waitExposed(host)

    def fill(b):  # the button's own background, left of its text
        img = b.grab().toImage()
        return img.pixelColor(6, img.height() // 2)

    on, off = fill(buttons["on"]), fill(buttons["off"])
    assert on.hsvSaturationF() > 0.5  # the enabled primary button is the accent colour
    assert off.hsvSaturationF() < 0.15  # disabled: grey, not a lighter accent
    plain = QPushButton("Cancel")
    plain.setEnabled(False)
    lay.addWidget(plain)
    qtbot.waitExposed(plain)
    assert abs(fill(plain).lightnessF() - off.lightnessF()) < 0.1  # like any disabled button
