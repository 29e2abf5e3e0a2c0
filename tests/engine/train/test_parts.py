"""The parts built together (engine.train.parts) over the demo model, without a training loop:
a checkpoint carries what every part remembers and a resume gives it back; the best-so-far
checkpoint skips the gallery; the good state after a rollback is saved once."""

import pytest
import torch

from engine.config import RunConfig
from engine.counters import Counters
from engine.resources import DEMO_PRESET
from engine.runs import step_of
from engine.train import checkpoint as ckpt
from engine.train.control import RunControl
from engine.train.data_setup import load_data
from engine.train.distributed import DistContext
from engine.train.model_setup import setup_model
from engine.train.optim import make_optimizer
from engine.train.parts import build_parts
from engine.train.reporting import Reporter
from engine.train.run_setup import configure, open_run_folder
from engine.train.schedule import StepPlan, lr_lambda


class Run:
    """The session's setup steps, in its order, with the events they report."""

    def __init__(self, tmp_path):
        cfg = RunConfig.load(DEMO_PRESET)
        cfg.output.dir, cfg.output.run_name = str(tmp_path), "parts"
        cfg.data.max_examples, cfg.data.max_seq_len = 60, 128
        cfg.training.device, cfg.training.max_steps, cfg.training.preflight = "cpu", 6, "off"
        cfg.training.gallery_prompts = ["What is the capital of France?"]
        self.events = []
        self.dist = dist = DistContext()
        self.reporter = Reporter(self.events.append)
        self.run = run = configure(cfg, dist, None, None, None)
        self.loaded = load_data(run.config, run.objective, self.reporter.log)
        open_run_folder(run.folder, dist, True, self.reporter, lambda: None)
        self.built = setup_model(run.config, run.device, dist, False, None, run.objective, lambda: None, print)
        t = run.config.training
        self.optimizer = make_optimizer(self.built.model, t.lr, t.weight_decay, t.optimizer)
        self.plan = StepPlan(len(self.loaded.data.packing.rows), int(t.rows_per_micro_batch), t.grad_accum, t.seed)
        self.total = self.plan.total_steps(t.max_steps, t.epochs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.scheduler, t.warmup_steps, self.total)
        )

    def parts(self):
        return build_parts(
            self.run,
            self.loaded,
            self.built,
            self.dist,
            self.plan,
            self.optimizer,
            self.scheduler,
            self.total,
            RunControl(self.reporter.emit, self.reporter.log),
            self.reporter,
            Counters(),
            None,
            0.01,
        )

    def kinds(self):
        return [e.kind for e in self.events]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("runs"))
    yield r
    r.reporter.close()


def test_a_checkpoint_carries_what_the_parts_remember_and_a_resume_gives_it_back(run):
    parts = run.parts()
    assert parts.total == run.total and parts.gallery and parts.report.mem_total > 0
    parts.loss_guard.rollbacks = 2
    parts.evaluator.best = {"step": 1, "eval_loss": 2.5, "checkpoint": None}
    parts.evaluator.bad_evals = 1
    del run.events[:]
    assert parts.save(1) is True
    assert run.kinds() == ["CheckpointSaved", "GalleryAnswers"] and parts.gallery.done == {1}
    last = parts.last()
    assert step_of(last) == 1 and last == parts.saver.last_checkpoint
    state = ckpt.load_checkpoint(last, run.built.model, run.optimizer, run.scheduler)
    assert state["step"] == 1 and state["total_steps"] == run.total and state["epoch"] == run.plan.epoch_at(1)

    resumed = run.parts()
    assert resumed.loss_guard.rollbacks == 0 and resumed.evaluator.best is None
    resumed.restore(state)
    assert resumed.loss_guard.rollbacks == 2 and resumed.evaluator.bad_evals == 1
    assert resumed.evaluator.best == parts.evaluator.best
    assert resumed.memory.state() == parts.memory.state()


def test_the_best_so_far_skips_the_gallery_and_the_good_state_is_saved_once(run):
    parts = run.parts()
    del run.events[:]
    assert parts.save_best(2) is True
    assert run.kinds() == ["CheckpointSaved"] and 2 not in parts.gallery.done
    # After a rollback to step 2: its checkpoint is there already, nothing is written.
    assert parts.save_good(2) == f"; the last good checkpoint is {parts.last()}"
    assert run.kinds() == ["CheckpointSaved"]
    # ... to step 3, newer than any checkpoint: it is written now, with the gallery.
    said = parts.save_good(3)
    assert step_of(parts.last()) == 3 and said == f"; its checkpoint is {parts.last()}"
    assert run.kinds() == ["CheckpointSaved", "CheckpointSaved", "GalleryAnswers"]
