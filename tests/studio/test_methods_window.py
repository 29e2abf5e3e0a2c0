"""Training methods from the window (issue 30): the Train page's method selector writes
training.method and the method's own settings; DPO and GRPO train the demo model from it, and the
Monitor's Method tab charts what each reports (preference: reward margins, accuracy, log-probs;
GRPO: reward per function, spread, completion length, KL) and GRPO's sampled completions with
their rewards at each log step, including the user's reward file. Waits for events, never times."""

from __future__ import annotations

import json
import re

import pytest
from studio_helpers import screenshot
from test_runs_page import configure, train

from tests.engine.train.test_methods_session import write_pairs, write_prompts


def test_the_selector_names_every_engine_method():
    from engine.train.objectives import known
    from studio.widgets.method_picker import METHODS

    assert sorted(METHODS) == sorted(known())


def show_method_tab(monitor) -> None:
    """The Method tab selected and given most of the page's height (for the screenshot)."""
    monitor.tabs.setCurrentWidget(monitor.method)
    split = monitor.tabs.parentWidget()
    split.setSizes([200, 600])
    monitor.method.refresh()


def pick(window, qtbot, method: str):
    page = window.training_panel.method
    page.box.setCurrentIndex(page.box.findData(method))
    assert window.state.get("training.method") == method
    return page


def type_into(qtbot, edit, text: str) -> None:
    edit.selectAll()
    qtbot.keyClicks(edit, text)


def test_dpo_trains_from_the_window_and_charts_its_margins(window, qtbot, runs_dir, tmp_path):
    configure(window, runs_dir, "dpo-window", steps=3)
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    with qtbot.waitSignal(dp.xray_ready, timeout=120_000):  # opened on the Data page, as a person does
        dp.load_source(str(write_pairs(tmp_path / "pairs.jsonl")))
    page = pick(window, qtbot, "dpo")
    assert "training.method" not in window.training_panel.form.fields  # one place to choose it
    assert page.preference.isVisibleTo(page) and not page.grpo.isVisibleTo(page)
    assert not page.user_code.isVisibleTo(page)
    type_into(qtbot, page.beta, "0.2")
    assert window.state.get("preference.beta") == 0.2
    assert window.training_panel.train.isEnabled(), window.training_panel.train_reason.text()
    finished = train(window, qtbot)
    assert finished.summary["steps"] == 3
    view = window.monitor_panel.method
    assert {"Rewards (preference)", "Reward accuracy", "Log-probs"} <= view.charts.keys()
    assert view.charts["Rewards (preference)"].point_count("margins") == 3
    assert view.charts["Log-probs"].point_count("chosen") == 3
    assert all(v < 0 for v in view.charts["Log-probs"].series("rejected").view()[1])
    assert not view.samples and not view.samples_panel.isVisibleTo(view)  # DPO samples nothing
    # The run's config is the window's: DPO with beta 0.2.
    cfg = (runs_dir / "dpo-window" / "config.yaml").read_text(encoding="utf-8")
    assert "method: dpo" in cfg and "beta: 0.2" in cfg
    show_method_tab(window.monitor_panel)
    screenshot(window.monitor_panel, "monitor-dpo")


def test_grpo_trains_from_the_window_with_the_users_reward_file(window, qtbot, runs_dir, tmp_path):
    reward = tmp_path / "short_answer.py"
    reward.write_text(
        "def reward(prompt, completion, answer='', **row):\n    return 1.0 if len(completion) < 40 else 0.0\n",
        encoding="utf-8",
    )
    configure(
        window, runs_dir, "grpo-window", steps=3, **{"data.source": str(write_prompts(tmp_path / "prompts.jsonl"))}
    )
    page = pick(window, qtbot, "grpo")
    assert page.grpo.isVisibleTo(page) and not page.preference.isVisibleTo(page)
    # The window says, in words a person sees, that the reward file is their code run here.
    assert page.user_code.isVisibleTo(page) and "runs your own Python code" in page.user_code.text()
    assert window.state.get("grpo.rewards") == [{"kind": "regex", "pattern": r"Answer: .+"}]  # a default reward
    type_into(qtbot, page.regex, "The .*")
    type_into(qtbot, page.group_size, "4")
    type_into(qtbot, page.max_new_tokens, "6")
    type_into(qtbot, page.grpo_beta, "0.04")
    page.set_reward_file(str(reward))  # what the file dialog's choice calls
    assert window.state.get("grpo.rewards") == [
        {"kind": "regex", "pattern": "The .*"},
        {"kind": "python", "file": str(reward)},
    ]
    assert window.state.get("grpo.group_size") == 4 and window.state.get("grpo.beta") == 0.04
    from studio.main_window import TRAIN

    window.go_to(TRAIN)
    screenshot(window, "train-grpo-method")
    finished = train(window, qtbot)
    assert finished.summary["steps"] == 3
    assert "KV cache" not in window.monitor_panel.fast_path_warning  # sampling is not a fallback
    view = window.monitor_panel.method
    assert {"Reward mean", "Reward spread (std)", "Completion length", "KL to the base"} <= view.charts.keys()
    for name in ("total", "format", "short_answer"):
        assert view.charts["Reward mean"].point_count(name) == 3
    assert all(0 < v <= 6 for v in view.charts["Completion length"].series("tokens").view()[1])
    # A table of the sampled completions at each log step: one row per completion (one prompt x 4).
    assert sorted(view.samples) == [1, 2, 3]
    assert view.table.rowCount() == 4 and view.step_box.currentData() == 3
    headers = [view.table.horizontalHeaderItem(j).text() for j in range(view.table.columnCount())]
    assert headers == ["prompt", "completion", "reward", "format", "short_answer"]
    for i, sample in enumerate(view.samples[3]):
        assert view.cell(i, "completion") == sample["completion"]
        text = sample["completion"]
        expected = (1.0 if re.fullmatch("The .*", text.strip(), re.DOTALL) else 0.0) + (len(text) < 40)
        assert sample["reward"] == pytest.approx(expected)  # the user's function really ran
    show_method_tab(window.monitor_panel)
    screenshot(window.monitor_panel, "monitor-grpo-completions")


def test_the_data_page_reads_preference_pairs_and_xrays_them(window, qtbot, tmp_path):
    """A pairs file on the Data page with DPO chosen: its format is named (not 'match no known
    shape'), Train is not blocked, an example shows the prompt with each answer trained, and the X-ray lists the
    pairs' own findings with their rows."""
    from PySide6.QtCore import Qt

    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    rows = [
        {"prompt": "What is 7 plus 5?", "chosen": "Answer: 12", "rejected": "Answer: 13"},
        {"prompt": "What is 2 plus 2?", "chosen": "Answer: 4", "rejected": "Answer: 4"},  # 1: identical sides
        {"prompt": "What is 3 plus 3?", "chosen": "", "rejected": "Answer: 6"},  # 2: empty side
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    box = window.training_panel.method.box  # DPO reads pairs (with SFT chosen, Train says which methods do)
    box.setCurrentIndex(box.findData("dpo"))
    with qtbot.waitSignal(dp.xray_ready, timeout=120_000):
        dp.load_source(str(path))
    assert "preference pairs" in dp.summary.text() and not dp.problem
    assert window.train_blocker() == ""
    view = dp.xray_view
    items = [view.tree.topLevelItem(i) for i in range(view.tree.topLevelItemCount())]
    by_kind = {it.data(0, Qt.ItemDataRole.UserRole): it for it in items}
    assert set(by_kind) == {"identical_sides", "empty_side"}
    assert by_kind["identical_sides"].child(0).text(1) == "2" and by_kind["empty_side"].child(0).text(1) == "3"
    assert "chosen" in by_kind["empty_side"].child(0).text(2)
    assert dp.tabs.tabText(4) == "X-ray (2)"
    qtbot.waitUntil(lambda: dp.example is not None and dp.example.index == 0, timeout=60_000)
    trained = "".join(text for text, on in dp.example.pieces if on)
    assert "12" in trained and "13" in trained  # both answers trained, after their prompt


def test_a_rollback_drops_the_method_curves_after_the_good_step(qtbot):
    """The Method tab's curves, like the Monitor's, end at the good step after a rollback (the
    rerun steps draw on from there instead of doubling back)."""
    from engine.api import RolledBack, StepMetrics
    from studio.panels.monitor import MonitorPanel

    m = MonitorPanel()
    qtbot.addWidget(m)
    m.begin()
    for step in range(1, 7):
        metrics = {"rewards/margins": 0.1 * step, "rewards/accuracies": 0.5}
        m.step(StepMetrics(step, 10, 0.0, 1.0, 1e-3, 1.0, 100, 50, 0.1, 1000.0, metrics=metrics))
    chart = m.method.charts["Rewards (preference)"]
    assert chart.point_count("margins") == 6
    assert m.notice(RolledBack(6, 3, "nan", float("nan"), 1e-3, 5e-4, "The loss turned NaN at step 6"))
    assert list(chart.series("margins").view()[0]) == [1.0, 2.0, 3.0]
    assert m.method.charts["Reward accuracy"].point_count("accuracy") == 3
