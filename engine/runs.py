"""The one place that knows a run folder's layout. Plain files only: no torch, no Qt.

A run folder::

    <run>/
      config.yaml              the RunConfig the run used (its presence makes a folder a run)
      metrics.jsonl            every event, one JSON object a line; the last line is the outcome
      log.txt                  the log lines, "HH:MM:SS level: message"
      checkpoints/step-N/      a complete checkpoint (written as step-N.tmp, then renamed)
        adapter/               a standard PEFT adapter (+ tokenizer files)
        optimizer.pt scheduler.pt rng.pt trainer_state.json
      adapter/                 the final adapter of a finished run (written as adapter.tmp)
      exports/<kind>.json      the report an export wrote about itself (kind: "adapter", "merged", ...)

API
---
Names: ``CONFIG``, ``METRICS``, ``LOG``, ``CHECKPOINTS``, ``ADAPTER``, ``EXPORTS``,
``STATE_FILE`` (trainer_state.json), ``ADAPTER_FILES`` (what makes a folder a PEFT adapter),
``TMP_SUFFIX`` (".tmp").

``RunFolder(path)`` -- paths and questions about one run folder:
  ``.path .config .metrics .log .checkpoints_dir .adapter .adapter_tmp .exports_dir``
  ``.checkpoint(step)``         checkpoints/step-N (whether or not it exists)
  ``.checkpoint_tmp(step)``     checkpoints/step-N.tmp, the folder written before the rename
  ``.export_report(kind)``      exports/<kind>.json
  ``.is_run()``                 config.yaml exists
  ``.checkpoints()``            [(step, folder)] of complete checkpoints, ascending
  ``.latest_checkpoint()``      the newest complete checkpoint, or None
  ``.final_adapter()``          adapter/ when it holds a complete adapter, else None
  ``.last_event()``             the last line of metrics.jsonl as a dict, or None
  ``.status()``                 "finished", "stopped", "failed" or "incomplete" (from the last event)
  ``.info()``                   a RunInfo
  ``.check_free(overwrite)``    raises RunFolderError when a new run may not start here
  ``.create(fresh)``            makes the folder and checkpoints/; ``fresh`` clears an old run first
  ``RunFolder.of(path)``        the RunFolder that a run, checkpoint or adapter folder belongs to

Functions:
  ``step_of(path)``             N for a ".../step-N" folder, -1 for anything else
  ``run_folder_of(path)``       run folder of a checkpoint folder (or of an adapter inside one,
                                or of a run's final adapter); a run folder itself otherwise
  ``resume_checkpoint(src)``    the checkpoint to resume from: a run folder's latest (None when it
                                has none), or ``src`` itself when it is a checkpoint folder
  ``is_adapter(path)``          the folder holds ADAPTER_FILES
  ``adapter_in(src)``           the adapter folder of an adapter, a checkpoint or a run folder (final
                                adapter first, then the latest checkpoint's), or None
  ``config_for(path)``          the config.yaml of the run a folder belongs to (walks up), or None
  ``tmp_for(final)``            the ".tmp" sibling a folder is written as before it is published
  ``publish(tmp, final)``       replace ``final`` by ``tmp`` (rename; the old one removed first;
                                files get the umask's permissions, e.g. 0644)
  ``read_run(path)``            a RunInfo, or None when ``path`` is not a run folder
  ``list_runs(root)``           RunInfo of every run folder directly under ``root``, newest first

``RunInfo(path, adapter, checkpoints, status)`` with ``.name`` and ``.sources()``: what can be
exported or chatted with, the final adapter first, then checkpoints newest first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LOG = "log.txt"
CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"
EXPORTS = "exports"
STATE_FILE = "trainer_state.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TMP_SUFFIX = ".tmp"

_STEP = re.compile(r"^step-(\d+)$")


class RunFolderError(RuntimeError):
    """A folder cannot hold a new run (it already holds one, or holds something else)."""


def step_of(path: str | Path) -> int:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else -1


def tmp_for(final: str | Path) -> Path:
    final = Path(final)
    return final.with_name(final.name + TMP_SUFFIX)


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_permissions(tmp: Path) -> None:
    """Give every file under `tmp` the permissions a plain new file gets (0644 under a 022 umask):
    safetensors writes 0600 files, which other users and tools then cannot read."""
    umask = _umask()
    files = [tmp] if tmp.is_file() else (p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        if p.is_symlink():
            continue
        full = 0o777 if p.stat().st_mode & 0o111 else 0o666
        try:
            os.chmod(p, full & ~umask)
        except OSError:
            pass  # not ours to change (e.g. another owner); the file is still usable


def publish(tmp: Path, final: Path) -> Path:
    """Put a fully written `tmp` folder in place of `final`: a reader sees the old one, nothing,
    or the new one, never a half-written one. Its files get the umask's permissions first."""
    _normal_permissions(Path(tmp))
    shutil.rmtree(final, ignore_errors=True)
    Path(tmp).rename(final)
    return Path(final)


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
        return RunFolder(src).latest_checkpoint()
    return src


def adapter_in(src: str | Path) -> Optional[Path]:
    src = Path(src)
    candidates = [src, src / ADAPTER]
    if (src / CHECKPOINTS).is_dir():
        latest = RunFolder(src).latest_checkpoint()
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


@dataclass
class RunInfo:
    path: Path
    adapter: Optional[Path]  # final adapter/ of a finished run
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)  # (step, folder), ascending
    status: str = ""  # "finished", "stopped", "failed", "incomplete" from the last event

    @property
    def name(self) -> str:
        return self.path.name

    def sources(self) -> list[tuple[str, Path]]:
        """What can be exported or chatted with: the final adapter, then checkpoints, newest first."""
        out = []
        if self.adapter is not None:
            out.append(("final adapter", self.path))
        out += [(f"checkpoint step {s}", p) for s, p in reversed(self.checkpoints)]
        return out


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def of(cls, path: str | Path) -> "RunFolder":
        return cls(run_folder_of(path))

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

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

    # -- questions ------------------------------------------------------------------------------
    def is_run(self) -> bool:
        return self.config.is_file()

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

    def last_event(self) -> Optional[dict]:
        try:
            with self.metrics.open("rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - 8192))  # the tail is enough: the last line is the outcome
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
            return json.loads(lines[-1]) if lines else None
        except (OSError, ValueError, IndexError):
            return None

    def status(self) -> str:
        last = self.last_event() or {}
        kind = last.get("event", "")
        outcome = {"Finished": "stopped" if last.get("stopped") else "finished", "Failed": "failed"}
        return outcome.get(kind, "incomplete")

    def info(self) -> RunInfo:
        return RunInfo(
            path=self.path, adapter=self.final_adapter(), checkpoints=self.checkpoints(), status=self.status()
        )

    # -- starting a run -------------------------------------------------------------------------
    def check_free(self, overwrite: bool = False) -> None:
        """Refuse a folder that already holds a run (unless `overwrite`) or holds anything else,
        and a path that is (or lies under) a file."""
        for p in (self.path, *self.path.parents):
            if p.exists():
                if not p.is_dir():
                    raise RunFolderError(f"the output must be a folder, but {p} is a file")
                break
        if self.path.exists() and any(self.path.iterdir()):
            if self.is_run() and not overwrite:
                raise RunFolderError(
                    f"the output folder {self.path} already holds a run; choose another run name or "
                    "folder, resume it, or set output.overwrite: true"
                )
            if not self.is_run():
                raise RunFolderError(
                    f"the output folder {self.path} is not empty and holds no run; choose an empty folder"
                )

    def create(self, fresh: bool) -> "RunFolder":
        """Make the folder and checkpoints/. `fresh`: a new run, so an old run here (only possible
        after check_free with overwrite) is removed first; a resumed run keeps what is there."""
        if fresh and self.is_run():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(exist_ok=True)
        return self


def read_run(path: str | Path) -> Optional[RunInfo]:
    run = RunFolder(path)
    return run.info() if run.is_run() else None


def list_runs(root: str | Path) -> list[RunInfo]:
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    runs = [r for r in (read_run(p) for p in root.iterdir() if p.is_dir()) if r is not None]
    runs.sort(key=lambda r: r.path.stat().st_mtime, reverse=True)
    return runs
