"""Local experiment logs (issue 14 item 9): with output.tensorboard the run writes its scalars
(loss, LR, grad norm, tokens/s, memory, eval loss) to <run>/tensorboard/, read back here with
TensorBoard's own reader; W&B is offline unless the environment says otherwise, and a missing
package is one log line saying how to install it, never a failed run."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_eval import config, losses, run

from engine.train.loggers import wandb_mode


def test_tensorboard_scalars_match_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(steps=3, eval_every=1)
    cfg.output.tensorboard = True
    run(cfg, tmp_path / "tb")
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_second", "memory/peak_bytes"} <= tags
    got = {e.step: e.value for e in acc.Scalars("train/loss")}
    expected = losses(tmp_path / "tb")
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - expected[s]) <= 1e-6 * abs(expected[s]) for s in got)
    evals = [json.loads(x) for x in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    evals = {e["step"]: e["eval_loss"] for e in evals if e["event"] == "EvalMetrics"}
    assert {e.step: round(e.value, 5) for e in acc.Scalars("eval/loss")} == {s: round(v, 5) for s, v in evals.items()}
    log = (tmp_path / "tb" / "log.txt").read_text()
    assert "TensorBoard log: " in log


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_missing_is_one_line_and_the_run_goes_on(tmp_path):
    cfg = config(steps=1, eval_every=0)
    cfg.output.wandb = True
    _, events = run(cfg, tmp_path / "wb")
    lines = [e.message for e in events if e.kind == "LogLine" and "Weights & Biases" in e.message]
    assert lines == [
        "output.wandb is on but the wandb package is not installed: pip install wandb "
        "(this run logs nothing to Weights & Biases)"
    ]
    assert events[-1].kind == "Finished"


def test_wandb_is_offline_unless_the_environment_says_otherwise():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "x"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == "disabled"
    assert wandb_mode({"WANDB_MODE": "Online"}) == "online"
