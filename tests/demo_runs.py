"""A short demo run on the CPU for tests that need a finished run folder (config.yaml + adapter/):
the bundled demo preset, a few steps, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

from engine.config import RunConfig
from engine.events import Finished
from engine.resources import DEMO_PRESET
from engine.train.session import TrainingSession


def short_demo_run(runs_dir: str | Path, name: str, steps: int = 2) -> Path:
    """Train the demo preset for `steps` steps into runs_dir/name; returns the run folder."""
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.data.max_examples = 40
    cfg.data.max_seq_len = 128
    cfg.training.max_steps = steps
    cfg.training.save_every = 0
    cfg.output.dir = str(runs_dir)
    cfg.output.run_name = name
    session = TrainingSession(cfg, lambda e: None)
    result = session.run()
    assert isinstance(result, Finished), getattr(result, "message", result)
    return session.run_dir
