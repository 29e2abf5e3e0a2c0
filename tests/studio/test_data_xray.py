"""The Data page's X-ray tab: findings by kind with their rows, a length histogram, and a
double-click that opens the row in the Example tab."""

from __future__ import annotations

import json

from PySide6.QtCore import Qt
from studio_helpers import screenshot


def _chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_xray_tab_lists_findings_and_opens_a_row(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    rows = [_chat(("user", f"q {i}"), ("assistant", f"a {i}")) for i in range(6)]
    rows.append(_chat(("user", "q 0"), ("assistant", "a 0")))  # 6: duplicate of row 0
    rows.append(_chat(("user", "q"), ("assistant", "word " * 700)))  # 7: answer cut at 512 tokens
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with qtbot.waitSignal(dp.xray_ready, timeout=120_000):
        dp.load_source(str(path))
    view = dp.xray_view
    kinds = {view.tree.topLevelItem(i).data(0, Qt.ItemDataRole.UserRole) for i in range(view.tree.topLevelItemCount())}
    assert kinds == {"duplicate", "truncated_answer"}
    assert dp.tabs.tabText(4) == "X-ray (2)"
    assert "8</b> rows checked" in view.summary.text() and "longer than max seq len" in view.summary.text()
    assert view.bars is not None and view.limit_line.value() == window.state.get("data.max_seq_len")
    from studio.main_window import DATA

    window.go_to(DATA)
    dp.tabs.setCurrentIndex(4)
    view.tree.expandAll()
    screenshot(window, "data-xray")

    dup = next(
        view.tree.topLevelItem(i)
        for i in range(view.tree.topLevelItemCount())
        if view.tree.topLevelItem(i).data(0, Qt.ItemDataRole.UserRole) == "duplicate"
    )
    child = dup.child(0)
    assert child.text(1) == "7" and "row 1" in child.text(2)  # rows read from 1: index 6 is row 7
    with qtbot.waitSignal(dp.example_ready, timeout=60_000):
        view.tree.itemDoubleClicked.emit(child, 1)
    assert dp.tabs.currentIndex() == 1 and dp.example_index.value() == 6

    # Back to clean data: the tab says so.
    with qtbot.waitSignal(dp.xray_ready, timeout=120_000):
        dp.load_source("demo")
    assert dp.tabs.tabText(4) == "X-ray ✓" and view.tree.topLevelItemCount() == 0
