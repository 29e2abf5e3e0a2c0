"""The Data page on a real family's template (Gemma-2 from the conformance suite): rows the chat
template rejects are listed with their number and reason in Problems and in the X-ray, the others
stay usable, and the example view shows the tokens' blanks and newlines."""

from __future__ import annotations

import json

from PySide6.QtCore import Qt

from tests.conformance.conversations import CONVERSATIONS
from tests.conformance.families import build_family_folder


def test_gemma2_system_rows_are_listed_not_fatal(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    window.state.set("model.name_or_path", str(build_family_folder("gemma-2")))
    names = ["single", "system_single", "multi_turn", "system_multi_turn"]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATIONS[n]}) + "\n" for n in names))
    with qtbot.waitSignal(dp.xray_ready, timeout=180_000):
        dp.load_source(str(path))
    view = dp.xray_view
    top = [view.tree.topLevelItem(i) for i in range(view.tree.topLevelItemCount())]
    rejected = next(t for t in top if t.data(0, Qt.ItemDataRole.UserRole) == "rejected")
    rows = [rejected.child(i).text(1) for i in range(rejected.childCount())]
    # Indices 1 and 3, read from 1.
    assert rows == ["2", "4"] and "System role not supported" in rejected.child(0).text(2)
    qtbot.waitUntil(lambda: dp.problems.rowCount() == 2, timeout=120_000)
    listed = {dp.problems.item(r, 0).text(): dp.problems.item(r, 1).text() for r in range(2)}
    assert set(listed) == {"2", "4"} and all("fold_system_message" in why for why in listed.values())
    with qtbot.waitSignal(dp.example_ready, timeout=60_000):
        dp.example_index.setValue(2)
    shown = dp.mask_view.text.toPlainText()
    assert "Name a volcano in Italy." in shown  # sentencepiece pieces keep their blanks
