"""A big data file keeps only its own X-ray busy (issue 28, item 1): while every row is being
checked, the Example follows the index asked for, the Model page reads its report and Runs lists
its folder; the X-ray says how far it is and stops on Cancel."""

from __future__ import annotations

import json

import pytest


def big_jsonl(path, rows: int) -> None:
    """Rows of a few hundred tokens each, like a real instruction set (generated, not downloaded)."""
    pad_q, pad_a = "Explain the steps. " * 20, "Adding the ones first, then the tens. " * 20
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            row = {
                "instruction": f"What is {i} plus {i % 97}? {pad_q}",
                "input": "",
                "output": f"{i + i % 97}. {pad_a}",
            }
            f.write(json.dumps(row) + "\n")


@pytest.mark.slow  # writes and reads a big file; the window's tasks end at teardown (70 s here)
def test_xray_of_a_big_file_blocks_nothing_else_and_cancels(window, qtbot, tmp_path):
    from studio import tasks

    dp = window.data_panel
    qtbot.waitUntil(lambda: window.engine_warm and not dp.loading and not tasks.pending("data.xray"), timeout=300_000)
    path = tmp_path / "big.jsonl"
    big_jsonl(path, 30_000)
    dp.load_source(str(path))
    # The X-ray has started and reported its first batch of rows.
    qtbot.waitUntil(lambda: dp.xray_progress.maximum() == 30_000, timeout=300_000)
    assert tasks.pending("data.xray")

    dp.example_index.setValue(7)
    qtbot.waitUntil(lambda: dp.example is not None and dp.example.index == 7, timeout=60_000)
    assert tasks.pending("data.xray"), "step 'Example follows the index': the X-ray ended first, nothing was shown"

    with qtbot.waitSignal(window.model_panel.report_ready, timeout=60_000):
        window.model_panel.refresh()
    with qtbot.waitSignal(window.runs_panel.refreshed, timeout=60_000):
        window.runs_panel.refresh()
    assert tasks.pending("data.xray"), "step 'Model and Runs answer': the X-ray ended first"
    assert dp.xray_progress.value() < 30_000

    dp.xray_cancel.click()
    qtbot.waitUntil(lambda: dp.tabs.tabText(4) == "X-ray (cancelled)", timeout=60_000)
    assert not tasks.pending("data.xray") and not dp.xray_cancel.isVisibleTo(dp)
    assert "cancelled" in dp.xray_view.summary.text()
