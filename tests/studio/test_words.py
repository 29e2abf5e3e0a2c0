"""Words that said the wrong thing (issue 28, item 10): the Run menu offered Pause, Resume and Stop
with no run; the Runs page's "Best loss" (the training loss) read like the Monitor's best (the eval
loss)."""

from __future__ import annotations


def test_run_menu_items_are_greyed_with_no_run(window):
    actions = window.run_actions
    assert not actions["Pause"].isEnabled() and not actions["Stop"].isEnabled()
    assert not actions["Resume"].isEnabled()  # no stopped run to continue in an empty runs folder


def test_runs_page_names_the_training_loss(window):
    page = window.runs_panel
    headers = [page.table.horizontalHeaderItem(c).text() for c in range(page.table.columnCount())]
    assert "Best train loss" in headers and "Best loss" not in headers
