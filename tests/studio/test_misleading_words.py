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
    assert [group.child(i).text(1) for i in range(group.childCount())] == ["5", "9", "30"]
