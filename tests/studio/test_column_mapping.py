"""Columns that match no known shape (issue 14 item 9): the Data page opens the mapping controls
under Format auto, words the message around them (no YAML), and a mapping makes the data usable."""

from __future__ import annotations

import json


def test_unknown_columns_open_the_mapping_under_auto(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None and not dp.loading, timeout=60_000)
    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(json.dumps({"q": f"What is {i} plus 1?", "a": f"Answer: {i + 1}"}) + "\n" for i in range(30)),
        encoding="utf-8",
    )
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source(str(path))

    editor = dp.mapping
    assert editor.format.currentText() == "auto"
    assert set(editor.boxes) >= {"instruction", "output"}
    for name in ("instruction", "output"):
        box = editor.boxes[name]
        assert box.isVisibleTo(dp) and box.isEnabled()
        assert [box.itemText(i) for i in range(box.count())][1:] == ["q", "a"]
    assert editor.apply.isVisibleTo(dp) and editor.apply.isEnabled()

    message = dp.banner.text()
    assert dp.banner.level == "error"
    assert "data.columns" not in message and "{" not in message
    assert "qa.jsonl" in message and "q, a" in message
    assert "Pick which column holds the prompt and which the answer below".lower() in message.lower()
    assert not window.training_panel.train.isEnabled()
    assert "data.columns" not in window.training_panel.train_reason.text()

    editor.boxes["instruction"].setCurrentText("q")
    editor.boxes["output"].setCurrentText("a")
    with qtbot.waitSignal(dp.packing_ready, timeout=60_000):
        editor.apply.click()
    assert window.state.get("data.format") == "auto"
    assert window.state.get("data.columns") == {"instruction": "q", "output": "a"}
    assert dp.preview.error is None and dp.preview.format.kind == "instruction"
    assert dp.problem == "" and dp.usable_examples == 30
    qtbot.waitUntil(lambda: dp.mask_view.num_trained > 0, timeout=60_000)
    assert "Answer" in dp.mask_view.text.toPlainText()
    qtbot.waitUntil(lambda: window.training_panel.train.isEnabled(), timeout=60_000)
    assert window.training_panel.train_reason.text() == ""
