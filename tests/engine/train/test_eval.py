"""Evaluation while training, on the demo (413 examples, so the default 5% split is on): the
held-out split is drawn with the seed and never trained on; the eval loss runs without
changing a single training loss (no grad, no RNG, no data position); a resumed run goes on with
the same evals; early stopping ends the run with a checkpoint and its adapter; the best
checkpoint is recorded in best.json and offered first; the Runs page's history has the eval
curve; running.lock marks a run in progress and is gone at the end."""

from __future__ import annotations

import json
import math

import numpy as np

from engine.api import RunConfig, RunFolder, event_from_dict, read_run
from engine.resources import DEMO_PRESET
from engine.train.session import TrainingSession


def config(steps=6, **training):
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.dtype = "float32"
    cfg.data.max_seq_len = 128
    t = cfg.training
    t.max_steps, t.rows_per_micro_batch, t.save_every, t.preflight = steps, 4, 0, "off"
    t.gallery_size = 0
    for k, v in training.items():
        setattr(t, k, v)
    return cfg


def run(cfg, folder, resume_from=None, on_event=None):
    events = []

    def seen(e):
        events.append(e)
        if on_event is not None:
            on_event(session, e)

    session = TrainingSession(cfg, seen, run_dir=folder, resume_from=resume_from)
    result = session.run()
    assert result.kind == "Finished", getattr(result, "detail", result)
    return session, events


def losses(folder):
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "StepMetrics":
            out[e["step"]] = e["loss"]
    return out


def test_the_split_is_held_out_and_the_eval_changes_no_training_loss(tmp_path):
    plain, _ = run(config(eval_every=0), tmp_path / "plain")
    held = plain._heldout
    assert len(held) == 21 and plain._summary["examples"] == 392 and plain._summary["eval_examples"] == 21
    train_docs = {tuple(d) for d in plain._data.docs}
    assert not any(tuple(d) in train_docs for d in held.docs), "a held-out example was trained on"
    # The same seed draws the same split; evals every 2 steps leave every training loss as it was.
    evald, events = run(config(eval_every=2), tmp_path / "eval")
    assert [tuple(d) for d in evald._heldout.docs] == [tuple(d) for d in held.docs]
    np.testing.assert_allclose(
        list(losses(tmp_path / "eval").values()), list(losses(tmp_path / "plain").values()), rtol=1e-6
    )
    evals = [e for e in events if e.kind == "EvalMetrics"]
    assert [e.step for e in evals] == [2, 4, 6]
    assert all(math.isfinite(e.eval_loss) and e.tokens > 0 and e.examples == 21 for e in evals)
    assert evals[-1].eval_loss < evals[0].eval_loss  # it learns what the held-out rows hold
    # best.json names the best checkpoint, and it is what Chat and Export are offered first.
    best = RunFolder(tmp_path / "eval").best()
    winner = min(evals, key=lambda e: e.eval_loss)
    assert best["step"] == winner.step and best["eval_loss"] == winner.eval_loss
    label, path = read_run(tmp_path / "eval").sources()[0]
    assert label == f"best (eval loss {winner.eval_loss:.4f} at step {winner.step})"
    assert path.name == f"step-{winner.step}"
    # The Runs page's history: the eval curve beside the loss, NaN where no eval ran.
    hist = RunFolder(tmp_path / "eval").history()
    curve = dict(zip(hist.steps, hist.curves["eval_loss"]))
    assert [s for s, v in curve.items() if math.isfinite(v)] == [2, 4, 6]
    assert curve[4] == evals[1].eval_loss
    # The run has ended: no lock, and the summary is not "running".
    assert not (tmp_path / "eval" / "running.lock").exists()
    assert RunFolder(tmp_path / "eval").summary().status == "finished"
    assert [
        e.kind
        for e in map(event_from_dict, map(json.loads, (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()))
    ].count("EvalMetrics") == 3


def test_a_resumed_run_keeps_its_evals_and_losses(tmp_path):
    _, straight = run(config(eval_every=2), tmp_path / "straight")

    def stop_at_3(session, e):
        if e.kind == "StepMetrics" and e.step == 3:
            session.request_stop()
        if e.kind == "StepMetrics":
            # While the step runs, the lock says a live process trains the run.
            assert RunFolder(session.run_dir).is_running()

    run(config(eval_every=2), tmp_path / "halted", on_event=stop_at_3)
    assert RunFolder(tmp_path / "halted").summary().status == "stopped"
    _, resumed = run(config(eval_every=2), tmp_path / "halted", resume_from=tmp_path / "halted")
    np.testing.assert_allclose(
        [losses(tmp_path / "halted")[s] for s in range(1, 7)],
        [losses(tmp_path / "straight")[s] for s in range(1, 7)],
        rtol=1e-6,
    )
    a = [(e.step, e.eval_loss) for e in straight if e.kind == "EvalMetrics"]
    b = [(e.step, e.eval_loss) for e in resumed if e.kind == "EvalMetrics"]
    assert b == [x for x in a if x[0] > 3]
    assert RunFolder(tmp_path / "halted").best()["step"] == RunFolder(tmp_path / "straight").best()["step"]


def test_early_stopping_ends_the_run_with_a_checkpoint_and_the_adapter(tmp_path):
    # A learning rate far too high: the eval loss stops improving within a few evals.
    session, events = run(
        config(steps=30, eval_every=1, early_stopping_patience=2, lr=0.05, spike_factor=0.0, scheduler="constant"),
        tmp_path / "early",
    )
    evals = [e for e in events if e.kind == "EvalMetrics"]
    finished = events[-1]
    assert evals[-1].stopping and evals[-1].evals_without_improvement == 2
    stopped_at = evals[-1].step
    assert stopped_at < 30 and finished.summary["steps"] == stopped_at and finished.summary["early_stopped"]
    assert not finished.stopped and (tmp_path / "early" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "early" / "checkpoints" / f"step-{stopped_at}").is_dir()
    log = (tmp_path / "early" / "log.txt").read_text()
    assert f"Early stopping at step {stopped_at}: the eval loss has not improved for 2 evals" in log
    best = min(evals, key=lambda e: e.eval_loss)
    assert finished.summary["best_step"] == best.step and RunFolder(tmp_path / "early").best()["step"] == best.step
    # Checkpoints written only for an earlier best are gone; the best one and the last remain.
    steps = [s for s, _ in RunFolder(tmp_path / "early").checkpoints()]
    assert steps == sorted({best.step, stopped_at})


def test_a_killed_run_is_not_running(tmp_path):
    folder = RunFolder(tmp_path / "killed").create(fresh=True)
    config().save(folder.config)
    (folder.path / "metrics.jsonl").write_text(
        '{"event": "RunStarted", "time": 1.0, "run_dir": "x", "config": {}, "hardware": {}, "total_steps": 5}\n'
    )
    folder.lock(pid=2**22 + 12345)  # no such process
    assert not folder.is_running() and folder.summary().status == "incomplete"
    folder.lock()  # this process
    assert folder.is_running() and folder.summary().status == "running"


def test_auto_eval_every_keeps_the_evals_a_small_share_of_the_training():
    from engine.train.evaluation import EVAL_SHARE, auto_eval_every

    # A long run with a small held-out set: about 10 evals.
    assert auto_eval_every(1000, 20_000, 30_000) == 100
    # A short run on a big data set (the held-out set is ~3.5 steps of tokens): evals spaced so
    # that their forwards (a third of a trained token each) cost at most EVAL_SHARE.
    every = auto_eval_every(20, 100_000, 28_672)
    assert every == 12 and (100_000 / 3) / (every * 28_672) <= EVAL_SHARE
    assert auto_eval_every(8, 10**7, 1_000) == 8  # never past the run's end: the last step has one
    assert auto_eval_every(3, 0, 1_000) == 1
