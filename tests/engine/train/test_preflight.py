"""The measured pre-flight on the CPU through the real TrainingSession: one forward + backward
rehearsed on the longest micro-batch before the first step. When the first choice does not
fit (the `Faults.oom_above_rows` seam: a forward over more rows runs out of memory) it picks a
smaller micro-batch and says so; it is not a training step, so a run with it gives the same
losses as one without, and a resume with it stays exact."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, RunConfig
from engine.events import CheckpointSaved, Finished, MemoryAdjusted, PreflightResult, StepMetrics
from engine.resources import DEMO_PRESET
from engine.train.preflight import Preflight
from engine.train.session import Faults, TrainingSession
from engine.train.step_runner import StepRunner


def config(tmp_path, steps=4, rows=4, accum=1, preflight="on", **training) -> RunConfig:
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.dtype = "float32"
    cfg.data.max_examples = 60
    cfg.data.max_seq_len = 128
    t = cfg.training
    t.max_steps, t.rows_per_micro_batch, t.grad_accum, t.save_every, t.preflight = steps, rows, accum, 0, preflight
    for k, v in training.items():
        setattr(t, k, v)
    cfg.output.dir = str(tmp_path)
    return cfg


def train(cfg, run_dir, faults=None, **kw):
    events = []
    result = TrainingSession(cfg, events.append, run_dir=run_dir, faults=faults, **kw).run()
    assert isinstance(result, Finished), getattr(result, "message", "") + getattr(result, "detail", "")
    return result, events


def losses(events):
    return [e.loss for e in events if isinstance(e, StepMetrics)]


@pytest.fixture(scope="module")
def without(tmp_path_factory):
    """The run without a rehearsal (auto is off on a CPU)."""
    tmp = tmp_path_factory.mktemp("without")
    result, events = train(config(tmp, preflight="auto"), tmp / "run")
    assert not [e for e in events if isinstance(e, PreflightResult)]
    return result, events


def test_the_rehearsal_is_not_a_training_step(tmp_path, without):
    result, events = train(config(tmp_path), tmp_path / "run")
    (pre,) = [e for e in events if isinstance(e, PreflightResult)]
    assert pre.attempts == 1 and pre.rows_per_micro_batch == 4 and pre.micro_batches_per_step == 1
    assert pre.step_seconds > 0 and pre.eta_seconds == pytest.approx(pre.step_seconds * 4)
    assert pre.peak_bytes == 0 and pre.device == "cpu" and pre.tokens > 0  # the CPU reports time only
    assert "Pre-flight" in pre.message and "ETA" in pre.message
    kinds = [e.kind for e in events]
    assert kinds.index("RunStarted") < kinds.index("PreflightResult") < kinds.index("StepMetrics")
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4]
    # Gradients discarded, RNG restored, data untouched: the same run, step for step.
    assert losses(events) == pytest.approx(losses(without[1]), rel=1e-6)


def test_it_picks_a_smaller_micro_batch_when_the_first_does_not_fit(tmp_path, without):
    # Like a card that holds one forward of at most 2 rows.
    result, events = train(config(tmp_path), tmp_path / "run", Faults(oom_above_rows=2))
    changes = [e for e in events if isinstance(e, MemoryAdjusted)]
    assert [(c.phase, c.step, c.setting, c.before, c.after) for c in changes] == [("preflight", 0, "micro_batch", 4, 2)]
    assert changes[0].message.startswith("micro-batch 4 → 2 rows")
    assert changes[0].message.endswith("the rehearsal ran out of memory.")
    (pre,) = [e for e in events if isinstance(e, PreflightResult)]
    assert (pre.attempts, pre.rows_per_micro_batch, pre.micro_batches_per_step) == (2, 2, 2)
    kinds = [e.kind for e in events]
    assert kinds.index("MemoryAdjusted") < kinds.index("PreflightResult") < kinds.index("StepMetrics")
    # No step ran out of memory (the rehearsal found what fits), and the global batch is the
    # same 4 rows: the losses equal the run without a rehearsal.
    assert len(changes) == 1
    assert losses(events) == pytest.approx(losses(without[1]), rel=1e-4)


def test_a_rehearsal_that_fits_only_without_adamws_state_lowers_a_setting(tmp_path, without):
    # The forward fits, but AdamW's moments (made at the first optimizer step; ~1 MiB for the
    # demo's adapters) would not fit beside it from the second step on: a card a few KiB over
    # what 4 rows peak at.
    gib = 2**30
    faults = Faults(rehearsal_peak=lambda a: a["rows"] * gib // 2, card_bytes=2 * gib + 4096)
    result, events = train(config(tmp_path), tmp_path / "run", faults)
    changes = [e for e in events if isinstance(e, MemoryAdjusted)]
    assert [(c.phase, c.setting, c.before, c.after) for c in changes] == [("preflight", "micro_batch", 4, 2)]
    assert "AdamW's state still to come" in changes[0].message and "over the 2.0 GiB of the card" in changes[0].message
    (pre,) = [e for e in events if isinstance(e, PreflightResult)]
    assert (pre.rows_per_micro_batch, pre.micro_batches_per_step) == (2, 2)
    assert losses(events) == pytest.approx(losses(without[1]), rel=1e-4)


def test_nothing_left_to_lower_ends_before_the_first_step_with_the_measurement(tmp_path):
    gib = 2**30
    faults = Faults(rehearsal_peak=lambda a: 3 * gib, card_bytes=2 * gib)
    cfg = config(tmp_path, rows=1, gradient_checkpointing=True, offload="single")
    events = []
    result = TrainingSession(cfg, events.append, run_dir=tmp_path / "run", faults=faults).run()
    assert result.kind == "Failed" and not [e for e in events if isinstance(e, StepMetrics)]
    assert result.message.startswith(
        "Out of GPU memory from the second step on: the pre-flight measured its peak, 3.0 GiB, and AdamW's state"
    )
    assert "To fit: lower data.max_seq_len (now 128)" in result.message


def test_over_the_card():
    from engine.train.preflight import over_the_card

    gib = 2**30
    assert over_the_card(0, gib, gib) == "" and over_the_card(gib, gib, 0) == ""  # nothing measured
    assert over_the_card(gib, gib // 2, 2 * gib) == ""
    assert over_the_card(gib, gib + 1, 2 * gib).endswith("are over the 2.0 GiB of the card")


def test_resume_with_the_rehearsal_stays_exact(tmp_path, without):
    cfg = config(tmp_path, save_every=2)
    session = TrainingSession(cfg, None, run_dir=tmp_path / "run")

    def stop_at_2(e):
        if isinstance(e, CheckpointSaved) and e.step == 2:
            session.request_stop()

    session.on_event = stop_at_2
    half = session.run()
    assert isinstance(half, Finished) and half.stopped and half.summary["steps"] == 2
    resumed, events = train(cfg, None, resume_from=tmp_path / "run")
    assert [e.kind for e in events].count("PreflightResult") == 1
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [3, 4]
    assert losses(events) == pytest.approx(losses(without[1])[2:], rel=1e-6)


def test_preflight_and_spike_factor_are_validated():
    cfg = RunConfig.from_dict({"training": {"preflight": "off", "spike_factor": 0}})
    assert cfg.training.preflight == "off" and cfg.training.spike_factor == 0
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"preflight": "sometimes"}})
    assert err.value.path == "training.preflight"
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"spike_factor": 0.5}})
    assert err.value.path == "training.spike_factor"


def test_grown_rows_fill_the_measured_room():
    from engine.train.preflight import grown_rows

    gib = 2**30
    # 2 GiB resident, 0.5 GiB a row, 2-row micro-batches, 8 per step, 6 GiB to fill: 8 rows fit.
    assert grown_rows(2 * gib, gib / 2, 2, 8, 6 * gib) == 8
    assert grown_rows(2 * gib, gib / 2, 14, 2, 11 * gib) == 18  # not only whole micro-batches
    assert grown_rows(2 * gib, gib / 2, 2, 8, 100 * gib) == 16  # at most the step's rows
    assert grown_rows(2 * gib, gib / 2, 20, 4, 12.5 * gib) == 20  # 21 rows: not worth a rehearsal
    assert grown_rows(2 * gib, gib / 2, 10, 4, 7.5 * gib) == 11  # 1.1x: worth one
    assert grown_rows(2 * gib, gib / 2, 2, 8, 2.5 * gib) == 2  # no room


def test_merged_micro_batches_train_like_the_planned_ones(tmp_path, monkeypatch):
    """When the rehearsal measures room (CUDA), the step's rows go in fewer, larger forwards:
    the same rows and loss normaliser, so the same losses as one forward per micro-batch."""
    _, planned = train(config(tmp_path, rows=1, accum=4), tmp_path / "planned")
    forwards = []

    def grow(self, measured):
        self.memory.rows = 3  # what grow_to_fill sets when 3 rows fit (the step has 4)
        return measured, 0

    monkeypatch.setattr(Preflight, "grow_to_fill", grow)
    real = StepRunner.micro_batches
    monkeypatch.setattr(
        StepRunner, "micro_batches", lambda self, step: forwards.append(real(self, step)) or forwards[-1]
    )
    result, events = train(config(tmp_path, rows=1, accum=4), tmp_path / "run")
    assert [[rows for rows, _ in step] for step in forwards] == [[3, 1]] * 4  # 4 rows a step in 2 forwards
    (pre,) = [e for e in events if isinstance(e, PreflightResult)]
    assert (pre.rows_per_micro_batch, pre.micro_batches_per_step) == (3, 2)
    assert losses(events) == pytest.approx(losses(planned), rel=1e-5)
