"""The methods' held-out measures on the Monitor (issue 30): an EvalMetrics carries the objective's
own metrics over the held-out examples (DPO's margins and accuracy, GRPO's reward of greedy
answers); the Method tab draws them dashed beside the training ones and the log names them."""

from __future__ import annotations


def _eval(step, loss, metrics):
    from engine import api

    return api.EvalMetrics(
        step=step, eval_loss=loss, tokens=8, examples=8, best_loss=loss, best_step=step, metrics=metrics
    )


def test_held_out_measures_sit_beside_the_training_ones(qtbot):
    from engine import api
    from studio.panels.monitor import MonitorPanel

    m = MonitorPanel()
    qtbot.addWidget(m)
    m.begin()
    step = api.StepMetrics(
        step=2,
        total_steps=4,
        epoch=0.5,
        loss=0.1,
        lr=1e-4,
        grad_norm=0.5,
        tokens=64,
        trained_tokens=32,
        step_seconds=0.2,
        tokens_per_second=320.0,
        metrics={"reward": 0.25, "completion_length": 6.0},
    )
    m.step(step)
    m.eval_metrics(_eval(2, -0.5, {"reward": 0.5, "completion_length": 7.0}))
    rewards = m.method.charts["Reward mean"]
    assert set(rewards._series) == {"total", "held-out total"}
    assert set(m.method.charts["Completion length"]._series) == {"tokens", "held-out tokens"}
    assert "held-out reward 0.5" in m.log.toPlainText()
    # An SFT eval has no measures of its own: nothing is added to the Method tab.
    m.begin()
    m.eval_metrics(_eval(2, 2.5, {}))
    assert m.method.charts == {} and "held-out" not in m.log.toPlainText()
