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
      export-report.json       the self-check's verdict of each kind's last export: {"exports": {kind: verdict}}
      best.json                the checkpoint of the best eval loss so far: {step, eval_loss, checkpoint}
      gallery.jsonl            the gallery's answers at each checkpoint: {step, prompt, answer} a line
      running.lock             {pid, host, started} while a process trains the run (removed at its end)
      tensorboard/             TensorBoard scalars (output.tensorboard)

API
---
Names: ``CONFIG``, ``METRICS``, ``LOG``, ``CHECKPOINTS``, ``ADAPTER``, ``EXPORTS``,
``STATE_FILE`` (trainer_state.json), ``ADAPTER_FILES`` (what makes a folder a PEFT adapter),
``TMP_SUFFIX`` (".tmp"), ``BEST`` (best.json), ``GALLERY`` (gallery.jsonl), ``LOCK``
(running.lock), ``TENSORBOARD``, ``CONTROL`` (the window's request to a run under torchrun),
``EXPORT_VERDICTS`` (export-report.json), ``OPTIMIZER_FILE`` ``SCHEDULER_FILE`` ``RNG_FILE``
(inside a checkpoint). ``RUNNING_WINDOW_S``: a run whose files were written this recently is being
written to. Nothing outside this module spells a file name of a run folder.

``RunFolder(path)`` -- paths and questions about one run folder:
  ``.path .config .metrics .log .checkpoints_dir .adapter .adapter_tmp .exports_dir .export_verdicts``
  ``.checkpoint(step)``         checkpoints/step-N (whether or not it exists)
  ``.checkpoint_tmp(step)``     checkpoints/step-N.tmp, the folder written before the rename
  ``.export_report(kind)``      exports/<kind>.json
  ``.is_run()``                 config.yaml exists
  ``.checkpoints()``            [(step, folder)] of complete checkpoints, ascending
  ``.latest_checkpoint()``      the newest complete checkpoint, or None
  ``.final_adapter()``          adapter/ when it holds a complete adapter, else None
  ``.last_event()``             the last line of metrics.jsonl as a dict, or None
  ``.status()``                 "finished", "stopped", "failed" or "incomplete" (from the last event,
                                by ``status_of``: the one rule, which the summary uses too)
  ``.why_not_resumable(ours)``  why the run cannot be resumed, one sentence ("" when it can): the
                                one decision (``resume_refusal``), which RunInfo/RunSummary use too;
                                ``ours``: the caller is training this run right now
  ``.written_within(s, now)``   metrics.jsonl or log.txt was written in the last ``s`` seconds
  ``.best()``                   best.json as a dict ({step, eval_loss, checkpoint}), or None
  ``.write_best(d)``            replaces best.json (written whole, then renamed)
  ``.gallery()``                [{step, prompt, answer, ...}] from gallery.jsonl (unreadable lines skipped)
  ``.append_gallery(records)``  appends records to gallery.jsonl
  ``.lock(pid)`` / ``.unlock()``  write / remove running.lock
  ``.is_running()``             running.lock is there and names a live process on this machine
  ``.control_file``             the window's request to a run under torchrun
  ``.info()``                   a RunInfo
  ``.check_free(overwrite)``    raises RunFolderError when a new run may not start here
  ``.check_writable()``         raises RunFolderError with ``write_problem``'s sentence
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
  ``write_problem(path)``       why no run can be written there (read-only, no permission, a full
                                disk), one sentence naming the folder and what to do; "" when one can
  ``new_run_folder(root, name, overwrite)``  (RunFolder, note): root/name, or the first free
                                name-2, name-3 ... when that is taken (the note says so)

``RunInfo(path, adapter, checkpoints, status, best)`` with ``.name`` and ``.sources()``: what can
be exported or chatted with: the best checkpoint (by eval loss, when best.json names one that
exists) first, then the final adapter, then checkpoints newest first; ``.why_not_resumable()`` and
``.resumable`` (the one decision). The Runs page's RunSummary is a RunInfo with more fields.

The status: ``status_of(outcome, running, problem)`` (the one rule) and ``shown_status(status, ours,
busy)``: what a window shows for it (its own run in progress, a run something is still writing).

Run history (the Runs page; never raises for a broken folder, it names the problem instead; the
code is engine.run_history's, these names still import from here):
  ``RunFolder.history()``       a RunHistory: per-step curves read back from metrics.jsonl
  ``RunFolder.summary(now)``    a RunSummary: one row of the run list (status, steps, losses...)
  ``RunFolder.rename(name)``    the folder under a new name in the same parent; a new RunFolder
  ``RunFolder.delete()``        removes a run folder (refuses a folder that is not a run)
  ``summarize_runs(root)``      RunSummary of every run-like folder directly under ``root``, newest
                                first, including partial ones (metrics or checkpoints, no config)
  ``config_differences(cfgs)``  [(dotted key, [value per config])] of the keys whose values differ
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

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
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
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
# A run whose metrics.jsonl or log.txt changed this recently is being written to (a writer
# mid-line, a run in another process).
RUNNING_WINDOW_S = 300.0

# Below this much free space a run's first checkpoint would not fit (a small model's adapter with
# its optimizer state is tens of MB): refused before anything loads (write_problem).
MIN_FREE_BYTES = 64 * 2**20

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
    best: Optional[dict] = None  # best.json: {step, eval_loss, checkpoint}

    @property
    def name(self) -> str:
        return self.path.name

    def best_checkpoint(self) -> Optional[tuple[int, Path, float]]:
        """(step, folder, eval loss) of the best checkpoint by eval loss, when it still exists."""
        best = self.best or {}
        step, loss = best.get("step"), best.get("eval_loss")
        if not isinstance(step, int) or not isinstance(loss, (int, float)):
            return None
        for s, p in self.checkpoints:
            if s == step:
                return s, p, float(loss)
        return None

    def sources(self) -> list[tuple[str, Path]]:
        """What can be exported or chatted with: the best checkpoint by eval loss first (when
        the run measured one), then the final adapter, then the checkpoints, newest first."""
        out = []
        best = self.best_checkpoint()
        if best is not None:
            out.append((best_label(best[2], best[0]), best[1]))
        if self.adapter is not None:
            out.append(("final adapter", self.path))
        out += [(f"checkpoint step {s}", p) for s, p in reversed(self.checkpoints) if best is None or s != best[0]]
        return out

    def why_not_resumable(self, ours: bool = False) -> str:
        """Why this run cannot be resumed, one sentence ("" when it can): `resume_refusal`.
        `ours`: the caller is training this run now, whatever its files say."""
        return resume_refusal(self.name, "running" if ours else self.status, bool(self.checkpoints))

    @property
    def resumable(self) -> bool:
        """A stopped, failed or interrupted run with a checkpoint to continue from."""
        return not self.why_not_resumable()


def status_of(outcome: Optional[dict], running: bool = False, problem: str = "") -> str:
    """A run's status from its last outcome event (the last Finished / Failed line of
    metrics.jsonl, None without one): "finished", "stopped", "failed"; without an outcome
    "running" while a process trains it, else "incomplete"; "corrupt" when `problem` names a
    file that cannot be read. The one rule: RunFolder.status() and the summary both use it."""
    outcome = outcome or {}
    if problem:
        return "corrupt"
    if outcome.get("event") == "Finished":
        return "stopped" if outcome.get("stopped") else "finished"
    if outcome.get("event") == "Failed":
        return "failed"
    return "running" if running else "incomplete"


def shown_status(status: str, ours: bool = False, busy: bool = False) -> str:
    """What a window shows for a run whose files say `status` (status_of's word): "running" for
    the run it is training now (`ours`: until the new RunStarted lands, a resumed run's files end
    with the earlier session's outcome), and for an incomplete run that something is still writing
    (`busy`); `status` otherwise."""
    if ours or (busy and status == "incomplete"):
        return "running"
    return status


def resume_refusal(name: str, status: str, has_checkpoint: bool) -> str:
    """Why a run with `status` cannot be resumed, one sentence ("" when it can): a stopped,
    failed or interrupted run with a checkpoint to continue from can. The one decision."""
    if status == "running":
        return f"{name} is running."
    if status == "finished":
        return f"{name} finished: there is nothing left to train."
    if status == "corrupt":
        return f"{name} has files that cannot be read."
    if not has_checkpoint:
        return f"{name} has no checkpoint to resume from."
    return ""


def best_label(eval_loss: float, step: int) -> str:
    """How Chat and Export name the best checkpoint."""
    return f"best (eval loss {eval_loss:.4f} at step {step})"


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

    @property
    def export_verdicts(self) -> Path:
        return self.path / EXPORT_VERDICTS

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
        """From the last line of metrics.jsonl alone (cheap): "running" is the summary's, which
        also looks at the lock."""
        return status_of(self.last_event())

    def why_not_resumable(self, ours: bool = False) -> str:
        """Why this run cannot be resumed, one sentence ("" when it can). Cheap: the last line of
        metrics.jsonl, the lock and the checkpoints folder, never the whole history. `ours`: the
        caller is training this run now (before its lock is written, or in a child process)."""
        if not self.is_run():
            return f"{self.path} is not a run folder (it has no config.yaml)."
        status = "running" if ours or self.is_running() else self.status()
        return resume_refusal(self.path.name, status, self.latest_checkpoint() is not None)

    def info(self) -> RunInfo:
        return RunInfo(
            path=self.path,
            adapter=self.final_adapter(),
            checkpoints=self.checkpoints(),
            status=self.status(),
            best=self.best(),
        )

    # -- best checkpoint, gallery, lock ---------------------------------------------------------
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

    def best(self) -> Optional[dict]:
        try:
            data = json.loads(self.best_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_best(self, data: dict) -> None:
        tmp = self.path / (BEST + TMP_SUFFIX)
        tmp.write_text(json.dumps(data, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.best_file)

    def gallery(self) -> list[dict]:
        try:
            lines = self.gallery_file.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a full disk or a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def append_gallery(self, records: list[dict]) -> None:
        with self.gallery_file.open("a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")

    def lock(self, pid: Optional[int] = None) -> None:
        """Mark the run as being trained by `pid` (this process by default)."""
        import socket

        info = {"pid": int(pid or os.getpid()), "host": socket.gethostname(), "started": time.time()}
        self.lock_file.write_text(json.dumps(info) + "\n", encoding="utf-8")

    def unlock(self) -> None:
        try:
            self.lock_file.unlink()
        except FileNotFoundError:
            pass

    def is_running(self) -> bool:
        """A process is training this run: running.lock names a process that is alive (on this
        machine; a lock from another host is taken at its word). A run whose process was killed
        leaves a lock whose pid is gone: not running."""
        import socket

        try:
            info = json.loads(self.lock_file.read_text(encoding="utf-8"))
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if info.get("host") not in (None, socket.gethostname()):
            return True
        return _pid_alive(pid)

    # -- history (the Runs page) ---------------------------------------------------------------
    def looks_like_run(self) -> bool:
        """A run folder, or what is left of one (metrics or checkpoints without a config.yaml)."""
        return self.is_run() or self.metrics.is_file() or self.checkpoints_dir.is_dir()

    def last_write(self) -> Optional[float]:
        """When the run's own files were last written (metrics.jsonl, log.txt), or None."""
        times = []
        for f in (self.metrics, self.log):
            try:
                times.append(f.stat().st_mtime)
            except OSError:
                pass
        return max(times) if times else None

    def written_within(self, seconds: float, now: Optional[float] = None) -> bool:
        """metrics.jsonl or log.txt was written in the last `seconds`."""
        written = self.last_write()
        return written is not None and (time.time() if now is None else now) - written < seconds

    def read_config(self) -> tuple[dict[str, Any], str]:
        """config.yaml as plain data and "" , or ({}, the problem in one sentence)."""
        import yaml

        if not self.config.is_file():
            return {}, f"{CONFIG} is missing from {self.path}"
        try:
            data = yaml.safe_load(self.config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            return {}, f"{self.config} cannot be read: {exc}"
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            return {}, f"{self.config} is not valid YAML{where}"
        if not isinstance(data, dict):
            return {}, f"{self.config} holds no settings"
        return data, ""

    def history(self, now: Optional[float] = None):
        """metrics.jsonl read back: a RunHistory (engine.run_history)."""
        from engine.run_history import read_history

        return read_history(self, now)

    def summary(self, now: Optional[float] = None):
        """One row of the run list: a RunSummary (engine.run_history); never raises."""
        from engine.run_history import summarize

        return summarize(self, now)

    def rename(self, new_name: str) -> "RunFolder":
        """Move the run to `new_name` in the same folder; checkpoints and adapters move with it
        (nothing inside a run refers to its own path, so it stays resumable and exportable). The
        name follows `run_name_problem`, the rule output.run_name follows too."""
        name = str(new_name).strip()
        why = run_name_problem(name)
        if why:
            raise RunFolderError(why)
        target = self.path.parent / name
        if target == self.path:
            return self
        if target.exists():
            raise RunFolderError(f"{target} already exists: choose another name")
        self.path.rename(target)
        return RunFolder(target)

    def delete(self) -> None:
        """Remove the run folder and everything in it; refuses a folder that is not a run."""
        if not self.looks_like_run():
            raise RunFolderError(f"{self.path} is not a run folder; nothing was deleted")
        shutil.rmtree(self.path)

    # -- starting a run -------------------------------------------------------------------------
    def check_free(self, overwrite: bool = False, disk_free: Optional[Callable[[Path], int]] = None) -> None:
        """Refuse a folder that already holds a run (unless `overwrite`) or holds anything else,
        a path that is (or lies under) a file, and a place where nothing can be written."""
        for p in (self.path, *self.path.parents):
            if p.exists():
                if not p.is_dir():
                    raise RunFolderError(f"the output must be a folder, but {p} is a file")
                break
        self.check_writable(disk_free)
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

    def check_writable(self, disk_free: Optional[Callable[[Path], int]] = None) -> None:
        """Raise RunFolderError with `write_problem`'s sentence when this run cannot be written:
        before anything loads, not as an OSError after the model and data did. What a write cut
        short left here (`partials`) is removed before anything is written, so its room counts as
        free: a resume after a full disk must not be refused for the space its own debris holds.
        `disk_free`: a test's stand-in for the free-space reading (engine.train.faults)."""
        reclaimable = sum(_size_of(p) for p in self.partials())
        problem = write_problem(self.path, disk_free=disk_free, reclaimable=reclaimable)
        if problem:
            raise RunFolderError(problem)

    def partials(self) -> list[Path]:
        """What a write cut short left here (checkpoints/step-N.tmp, adapter.tmp): nothing reads
        them, and the run removes them before it writes (engine.train.checkpoint.remove_partials)."""
        found = []
        if self.checkpoints_dir.is_dir():
            found += [p for p in self.checkpoints_dir.iterdir() if p.name.endswith(TMP_SUFFIX)]
        if self.adapter_tmp.exists():
            found.append(self.adapter_tmp)
        return found

    def create(self, fresh: bool) -> "RunFolder":
        """Make the folder and checkpoints/. `fresh`: a new run, so an old run here (only possible
        after check_free with overwrite) is removed first; a resumed run keeps what is there."""
        if fresh and self.is_run():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(exist_ok=True)
        return self


def write_problem(path: str | Path, disk_free: Optional[Callable[[Path], int]] = None, reclaimable: int = 0) -> str:
    """Why no run can be written at `path` (a runs folder or a run folder, made when missing), one
    sentence naming the folder and what to do; "" when one can. Cheap and writes nothing: the
    nearest folder that exists must let this process make files in it (a read-only disk, or
    missing permission, fails) and its disk must have room for a first checkpoint."""
    p = Path(path).expanduser()
    existing = next((q for q in (p, *p.parents) if q.exists()), None)
    if existing is None or not existing.is_dir():
        return ""  # check_free names a file in the way
    where = str(existing) if existing == p else f"{existing} (where {p} would be made)"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only disk" if _read_only(existing) else "is not writable by you"
        return (
            f"Runs cannot be saved: {where} {why}. Choose another runs folder (output.dir) or make "
            "that folder writable, then train again."
        )
    try:
        free = int(disk_free(existing)) if disk_free else shutil.disk_usage(existing).free
    except OSError:
        return ""
    free += reclaimable  # room the run frees before it writes (RunFolder.partials)
    if free < MIN_FREE_BYTES:
        return (
            f"Runs cannot be saved: the disk holding {existing} is full ({free / 2**20:.0f} MB free). Free some "
            "space or choose a runs folder on another disk (output.dir), then train again."
        )
    return ""


def _size_of(path: Path) -> int:
    """Bytes under `path` (a file or a folder), 0 for what vanished meanwhile."""
    try:
        if path.is_file() or path.is_symlink():
            return path.lstat().st_size
        return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    except OSError:
        return 0


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        return False


def run_name_problem(name: str) -> str:
    """Why `name` cannot name a run, one sentence ("" when it can): the one rule, for a name typed
    in the Runs page's Rename and for output.run_name. A run is a folder, so what a folder name may
    hold is fine (spaces, accents, emoji); a path separator, a control character, "." or "..", a
    name longer than file systems allow (255 bytes) or the half-written mark (.tmp) are not."""
    text = str(name)
    if not text.strip() or text.strip() in (".", ".."):
        return f"{text!r} cannot be a folder name: a run needs a name other than '.' or '..'"
    bad = sorted({c for c in text if c in "/\\" or c == os.sep or ord(c) < 32 or ord(c) == 127})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return f"{text!r} cannot be a folder name: it holds {shown} (spaces, accents and emoji are fine)"
    if len(text.encode("utf-8")) > 255:
        return f"a run name may be at most 255 bytes long as a folder name ({len(text.encode('utf-8'))} given)"
    if text.endswith(TMP_SUFFIX):
        return f"a run name may not end in {TMP_SUFFIX} (that marks half-written folders)"
    return ""


def new_run_folder(root: str | Path, name: str, overwrite: bool = False) -> tuple["RunFolder", str]:
    """The folder of a new run called `name` under `root` ("auto": run-YYYYmmdd-HHMMSS), and a
    sentence when it is not root/name: a name already taken (a folder holding a run, or anything
    else) gives the first free name-2, name-3, ..., so a fixed output.run_name in a loaded config
    trains every time instead of failing every later Train; `overwrite` (output.overwrite) reuses
    a run's folder, as it always did. The one rule for a new run's folder (the session, and the
    callers that fix the folder before starting processes under torchrun)."""
    root = Path(root).expanduser()
    if name == "auto":
        name = datetime.now().strftime("run-%Y%m%d-%H%M%S")
    why = run_name_problem(name)
    if why:
        raise RunFolderError(f"output.run_name: {why}")
    first = RunFolder(root / name)
    if not _taken(first.path) or (overwrite and first.is_run()):
        return first, ""
    n = 2
    while _taken(root / f"{name}-{n}"):
        n += 1
    folder = RunFolder(root / f"{name}-{n}")
    what = "holds a run" if first.is_run() else "is in the way"
    return folder, f"{first.path} already {what}: this run is {folder.path.name}"


def _taken(path: Path) -> bool:
    """Something is at `path` that a new run may not be written into (an empty folder is free)."""
    if not path.exists():
        return False
    return not path.is_dir() or any(path.iterdir())


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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    except OSError:
        return False
    return True


# The run history (the Runs page) lives in engine.run_history; its names are still importable
# from here, where the Runs page and engine.api have always found them.
_HISTORY_NAMES = (
    "CURVES",
    "EVAL_CURVES",
    "RunHistory",
    "RunSummary",
    "summarize_runs",
    "config_differences",
)


def __getattr__(name: str):
    if name in _HISTORY_NAMES:
        from engine import run_history

        return getattr(run_history, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
