"""Runs of the methods beyond SFT in the Runs page and Chat (issue 30): a tiny DPO run and a tiny
GRPO run trained here on the demo (the real TrainingSession, 3 steps each) are overlaid on the
metric the person picks from what the runs logged (the loss both share; the reward margin only
DPO logged, the mean reward and KL only GRPO), and Chat's base vs tuned view answers for each
run's adapter. A real window; waits for signals, never times."""

from __future__ import annotations

import math

import pytest
from PySide6.QtCore import Qt
from studio_helpers import screenshot
from test_runs_page import select, show_runs

from engine.config import RewardConfig
from tests.engine.train.test_methods_session import config, run, write_pairs, write_prompts


@pytest.fixture
def method_runs(tmp_path, runs_dir):
    """A DPO run and a GRPO run in the window's runs folder (config() writes to tmp_path/runs).
    Tests name it before `window`, so the runs train before the window's warm-up imports start on
    their thread (training beside them can meet a half-imported transformers: test_startup_race)."""
    assert runs_dir == tmp_path / "runs"
    dpo = config(tmp_path, "dpo", write_pairs(tmp_path / "pairs.jsonl"))
    dpo.output.run_name = "dpo-run"
    grpo = config(tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl"))
    grpo.output.run_name = "grpo-run"
    grpo.grpo.group_size = 4
    grpo.grpo.max_new_tokens = 6
    grpo.grpo.beta = 0.04
    grpo.grpo.rewards = [RewardConfig(kind="regex", pattern=r"Answer: [^\n]+")]
    for cfg in (dpo, grpo):
        run(cfg)
    return runs_dir / "dpo-run", runs_dir / "grpo-run"


def test_the_runs_overlay_compares_runs_of_any_method_on_a_picked_metric(method_runs, window, qtbot):
    page = show_runs(window, qtbot)
    select(page, qtbot, ["dpo-run", "grpo-run"])
    overlay = page.overlay
    metrics = overlay.logged()
    assert metrics[0] == "loss" and {"rewards/margins", "rewards/accuracies", "reward", "kl"} <= set(metrics)
    labels = [overlay.box.itemText(i) for i in range(overlay.box.count())]
    assert "Reward margin (chosen − rejected)" in labels and "Mean reward" in labels and "KL to the base" in labels
    # The loss: both runs, one line each.
    assert overlay.set_metric("loss")
    assert overlay.chart.point_count("dpo-run") == 3 and overlay.chart.point_count("grpo-run") == 3
    assert overlay.note.text() == "Logged by all 2 runs."
    # A preference metric: the DPO run only, and the caption names the run that did not log it.
    assert overlay.set_metric("rewards/margins")
    assert overlay.chart.point_count("dpo-run") == 3 and "grpo-run" not in overlay.chart.curves
    assert "Not logged by grpo-run" in overlay.note.text()
    margins = overlay.chart.values("dpo-run")
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # DPO starts with the policy equal to the reference
    assert overlay.set_metric("reward")
    assert overlay.chart.point_count("grpo-run") == 3 and "dpo-run" not in overlay.chart.curves
    assert all(0.0 <= v <= 1.0 for v in overlay.chart.values("grpo-run"))  # one 0/1 format reward
    screenshot(window, "runs-methods-overlay")
    # The picked metric stays when the selection still logged it; one run alone keeps working.
    select(page, qtbot, ["grpo-run"])
    assert overlay.picked() == "reward" and overlay.chart.point_count("grpo-run") == 3
    select(page, qtbot, ["dpo-run"])
    assert overlay.picked() == "loss" and "reward" not in overlay.logged()
    assert all(math.isfinite(v) for v in overlay.chart.values("dpo-run"))


def test_chat_compares_base_and_tuned_for_a_dpo_and_a_grpo_run(method_runs, window, qtbot):
    from studio.main_window import CHAT

    window.go_to(CHAT)
    cp = window.chat_panel
    cp.refresh()
    for folder in method_runs:
        i = cp.source.findData(str(folder))  # the run's final adapter
        assert i >= 0, [cp.source.itemData(j) for j in range(cp.source.count())]
        cp.source.setCurrentIndex(i)
        cp.with_base.setChecked(True)
        cp.prompt.setPlainText("What is 2 plus 3?")
        cp.max_tokens.setValue(6)
        with qtbot.waitSignal(cp.replied, timeout=180_000) as replied:
            qtbot.mouseClick(cp.send, Qt.MouseButton.LeftButton)
        result = replied.args[0]
        assert isinstance(result["tuned"], str) and isinstance(result["base"], str), result
        assert cp.tuned.toPlainText() == result["tuned"] and cp.base.toPlainText() == result["base"]
        assert str(cp.model.adapter_dir) == str(folder / "adapter"), cp.model.adapter_dir
