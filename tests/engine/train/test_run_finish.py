"""The run's summary on its own (engine.train.finish): what the Finished event carries, from the
evaluator's memory and the steps' tokens per second."""

import time
from types import SimpleNamespace

from engine.config import RunConfig
from engine.resources import DEMO_PRESET
from engine.train.distributed import DistContext
from engine.train.evaluator import Evaluator
from engine.train.finish import median, run_summary
from engine.train.reporting import Reporter


def evaluator(tmp_path):
    training = RunConfig.load(DEMO_PRESET).training
    training.eval_every = 0
    # No held-out examples: the evaluator never runs a forward, so it needs no model.
    runner = SimpleNamespace(dist=DistContext())
    return Evaluator(runner, None, training, 10, Reporter(None), None, 128)


def test_the_summary_of_a_finished_run_names_its_adapter_and_best_eval(tmp_path):
    ev = evaluator(tmp_path)
    best = {"step": 6, "eval_loss": 1.25, "checkpoint": str(tmp_path / "checkpoints" / "step-6")}
    ev.restore({"best": best})
    ev.early_stopped = True
    started = time.time() - 3
    summary = run_summary(
        8, 10, 0.5, started, [30.0, 10.0, 20.0], tmp_path / "adapter", tmp_path / "checkpoints" / "step-8", ev
    )
    seconds = summary.pop("seconds")
    assert 3 <= seconds and round(seconds, 2) == seconds
    assert summary == {
        "steps": 8,
        "total_steps": 10,
        "final_loss": 0.5,
        "median_tokens_per_second": 20.0,
        "adapter": str(tmp_path / "adapter"),
        "last_checkpoint": str(tmp_path / "checkpoints" / "step-8"),
        "early_stopped": True,
        "best_eval_loss": 1.25,
        "best_step": 6,
        "best_checkpoint": best["checkpoint"],
    }


def test_a_stopped_run_without_evals_has_no_adapter_and_no_best(tmp_path):
    summary = run_summary(3, 10, float("nan"), time.time(), [], None, tmp_path / "step-3", evaluator(tmp_path))
    assert summary["adapter"] is None and summary["median_tokens_per_second"] == 0.0
    assert summary["best_eval_loss"] is summary["best_step"] is summary["best_checkpoint"] is None
    assert summary["early_stopped"] is False


def test_the_median_is_the_upper_middle_value():
    assert median([]) == 0.0
    assert median([5.0]) == 5.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 3.0  # the higher of the two middle values
