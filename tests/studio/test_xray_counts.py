"""The X-ray tab counts every finding of a kind, also those the engine counted without keeping their
rows (engine.data.xray.KEPT_PER_KIND bounds what a big file's X-ray holds, issue 28)."""

from __future__ import annotations


def test_xray_tab_counts_the_findings_not_kept(qtbot, monkeypatch):
    from engine.data import xray
    from studio.widgets.data_xray import DataXRay

    monkeypatch.setattr(xray, "KEPT_PER_KIND", 2)
    x = xray.XRay(rows=6, max_seq_len=64, lengths=[10] * 6)
    for r in range(1, 6):
        x.add("duplicate", r, "same as row 0")
    assert len(x.findings) == 2 and x.counts()["duplicate"] == 5

    view = DataXRay()
    qtbot.addWidget(view)
    assert view.set_xray(x, {"duplicate": "duplicate rows"}) == 5
    group = view.tree.topLevelItem(0)
    assert "5 rows" in group.text(0)
    # Indices 1 and 2, read from 1.
    assert [group.child(i).text(1) for i in range(group.childCount())] == ["2", "3", "…"]
    assert "3 more" in group.child(2).text(2)
    assert "5</b> findings" in view.summary.text()
