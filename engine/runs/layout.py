"""Where each file of a run folder lies: the names, and the paths of one run folder (RunLayout).

Only names and paths, and the questions a listing answers (is it a run, which checkpoints are
complete, is the final adapter there); nothing here reads a file's contents. Nothing outside
engine.runs spells a file name of a run folder (tests/engine/test_one_home.py checks it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LOG = "log.txt"
CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"
EXPORTS = "exports"
STATE_FILE = "trainer_state.json"
# Inside a checkpoint folder, beside adapter/ and STATE_FILE (engine.train.checkpoint writes them).
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
# What makes a folder a PEFT adapter (PEFT's own names): its config and its weights.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
TMP_SUFFIX = ".tmp"
BEST = "best.json"
GALLERY = "gallery.jsonl"
LOCK = "running.lock"
TENSORBOARD = "tensorboard"
# The window's request to a run under torchrun ("pause", "resume" or "stop"), read by rank 0
# between steps: torchrun forwards SIGINT/SIGTERM but has no pause.
CONTROL = "control"
# The self-check verdicts of a run's exports, beside config.yaml (engine.export writes it).
EXPORT_VERDICTS = "export-report.json"

_STEP = re.compile(r"^step-(\d+)$")


class RunFolderError(RuntimeError):
    """A folder cannot hold a new run (it already holds one, or holds something else)."""


def failure_log(root: str | Path, when: float | None = None) -> Path:
    """The file a window writes a failure's traceback to when the run made no folder of its own:
    failed-YYYYmmdd-HHMMSS.log.txt in the runs folder `root` (a run's own failure goes to its log.txt)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return Path(root) / f"failed-{stamp}.{LOG}"


def step_of(path: str | Path) -> int:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else -1


def tmp_for(final: str | Path) -> Path:
    final = Path(final)
    return final.with_name(final.name + TMP_SUFFIX)


def is_adapter(path: str | Path) -> bool:
    return all((Path(path) / f).is_file() for f in ADAPTER_FILES)


def run_folder_of(path: str | Path) -> Path:
    p = Path(path)
    if p.name == ADAPTER and (p.parent.parent.name == CHECKPOINTS or (p.parent / CONFIG).is_file()):
        p = p.parent
    if p.parent.name == CHECKPOINTS:
        p = p.parent.parent
    return p


def resume_checkpoint(src: str | Path) -> Optional[Path]:
    src = Path(src)
    if (src / CHECKPOINTS).is_dir():
        return RunLayout(src).latest_checkpoint()
    return src


def adapter_in(src: str | Path) -> Optional[Path]:
    src = Path(src)
    candidates = [src, src / ADAPTER]
    if (src / CHECKPOINTS).is_dir():
        latest = RunLayout(src).latest_checkpoint()
        if latest is not None:
            candidates.append(latest / ADAPTER)
    for c in candidates:
        if is_adapter(c):
            return c
    return None


def config_for(path: str | Path, levels: int = 5) -> Optional[Path]:
    p = Path(path)
    for parent in [p, *p.parents][:levels]:
        cfg = parent / CONFIG
        if cfg.is_file():
            return cfg
    return None


class RunLayout:
    """The paths of one run folder (whether or not they exist) and what its listing says.
    RunFolder (engine.runs.folder) is a RunLayout with the questions that read the files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    # -- paths ----------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def log(self) -> Path:
        return self.path / LOG

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def adapter(self) -> Path:
        return self.path / ADAPTER

    @property
    def adapter_tmp(self) -> Path:
        return tmp_for(self.adapter)

    @property
    def exports_dir(self) -> Path:
        return self.path / EXPORTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{int(step)}"

    def checkpoint_tmp(self, step: int) -> Path:
        return tmp_for(self.checkpoint(step))

    def export_report(self, kind: str) -> Path:
        return self.exports_dir / f"{kind}.json"

    @property
    def export_verdicts(self) -> Path:
        return self.path / EXPORT_VERDICTS

    @property
    def best_file(self) -> Path:
        return self.path / BEST

    @property
    def gallery_file(self) -> Path:
        return self.path / GALLERY

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def control_file(self) -> Path:
        return self.path / CONTROL

    # -- what the listing says ------------------------------------------------------------------
    def is_run(self) -> bool:
        return self.config.is_file()

    def looks_like_run(self) -> bool:
        """A run folder, or what is left of one (metrics or checkpoints without a config.yaml)."""
        return self.is_run() or self.metrics.is_file() or self.checkpoints_dir.is_dir()

    def checkpoints(self) -> list[tuple[int, Path]]:
        cdir = self.checkpoints_dir
        if not cdir.is_dir():
            return []
        found = [(step_of(c), c) for c in cdir.iterdir() if c.is_dir()]
        return sorted((s, c) for s, c in found if s >= 0)

    def latest_checkpoint(self) -> Optional[Path]:
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def final_adapter(self) -> Optional[Path]:
        return self.adapter if is_adapter(self.adapter) else None

    def partials(self) -> list[Path]:
        """What a write cut short left here (checkpoints/step-N.tmp, adapter.tmp): nothing reads
        them, and the run removes them before it writes (engine.train.checkpoint.remove_partials)."""
        found = []
        if self.checkpoints_dir.is_dir():
            found += [p for p in self.checkpoints_dir.iterdir() if p.name.endswith(TMP_SUFFIX)]
        if self.adapter_tmp.exists():
            found.append(self.adapter_tmp)
        return found
