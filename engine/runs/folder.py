"""RunFolder: one run folder, its paths (RunLayout) and every question and change about it in one
object, each answered by the module that holds the rule (records, status, history, checks). Also
the one rule for a new run's folder (`new_run_folder`)."""

from __future__ import annotations

import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from engine.runs import checks, records
from engine.runs import history as run_history
from engine.runs import status as run_status
from engine.runs.layout import RunFolderError, RunLayout, run_folder_of
from engine.runs.status import RunInfo


class RunFolder(RunLayout):
    @classmethod
    def of(cls, path: str | Path) -> "RunFolder":
        """The RunFolder that a run, checkpoint or adapter folder belongs to."""
        return cls(run_folder_of(path))

    # -- status and resuming (engine.runs.status) -----------------------------------------------
    def last_event(self) -> Optional[dict]:
        """The last line of metrics.jsonl as a dict, or None."""
        return records.last_event(self)

    def status(self) -> str:
        """From the last line of metrics.jsonl alone (cheap): "running" is the summary's, which
        also looks at the lock."""
        return run_status.folder_status(self)

    def why_not_resumable(self, ours: bool = False) -> str:
        """Why this run cannot be resumed, one sentence ("" when it can): the one decision.
        `ours`: the caller is training this run now (before its lock is written, or in a child process)."""
        return run_status.why_not_resumable(self, ours)

    def info(self) -> RunInfo:
        return run_status.info_of(self)

    # -- best checkpoint, gallery, lock (engine.runs.records) -----------------------------------
    def best(self) -> Optional[dict]:
        return records.read_best(self)

    def write_best(self, data: dict) -> None:
        records.write_best(self, data)

    def gallery(self) -> list[dict]:
        return records.read_gallery(self)

    def append_gallery(self, items: list[dict]) -> None:
        records.append_gallery(self, items)

    def lock(self, pid: Optional[int] = None) -> None:
        """Mark the run as being trained by `pid` (this process by default)."""
        records.write_lock(self, pid)

    def unlock(self) -> None:
        records.remove_lock(self)

    def write_control(self, request: str) -> None:
        """The window's request to a run under torchrun, written whole (records.write_control)."""
        records.write_control(self, request)

    def is_running(self) -> bool:
        """A process is training this run: running.lock names a live process (records.lock_is_live)."""
        return records.lock_is_live(self)

    def trained_elsewhere(self) -> bool:
        """Another live process is training this run (records.locked_by_another_process)."""
        return records.locked_by_another_process(self)

    # -- history (the Runs page; engine.runs.history) -------------------------------------------
    def last_write(self) -> Optional[float]:
        """When the run's own files were last written (metrics.jsonl, log.txt), or None."""
        return records.last_write(self)

    def written_within(self, seconds: float, now: Optional[float] = None) -> bool:
        """metrics.jsonl or log.txt was written in the last `seconds`."""
        written = self.last_write()
        return written is not None and (time.time() if now is None else now) - written < seconds

    def read_config(self) -> tuple[dict[str, Any], str]:
        """config.yaml as plain data and "" , or ({}, the problem in one sentence)."""
        return records.read_config(self)

    def history(self, now: Optional[float] = None) -> run_history.RunHistory:
        """metrics.jsonl read back: a RunHistory."""
        return run_history.read_history(self, now)

    def summary(self, now: Optional[float] = None) -> run_history.RunSummary:
        """One row of the run list: a RunSummary; never raises."""
        return run_history.summarize(self, now)

    def rename(self, new_name: str) -> "RunFolder":
        """Move the run to `new_name` in the same folder; checkpoints and adapters move with it
        (nothing inside a run refers to its own path, so it stays resumable and exportable). The
        name follows `run_name_problem`, the rule output.run_name follows too."""
        name = str(new_name).strip()
        why = checks.run_name_problem(name)
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

    # -- starting a run (engine.runs.checks) ----------------------------------------------------
    def check_free(self, overwrite: bool = False, disk_free: Optional[Callable[[Path], int]] = None) -> None:
        """Raise RunFolderError when a new run may not start here (checks.check_free)."""
        checks.check_free(self, overwrite, disk_free)

    def check_writable(self, disk_free: Optional[Callable[[Path], int]] = None) -> None:
        """Raise RunFolderError with `write_problem`'s sentence (checks.check_writable)."""
        checks.check_writable(self, disk_free)

    def create(self, fresh: bool) -> "RunFolder":
        """Make the folder and checkpoints/. `fresh`: a new run, so an old run here (only possible
        after check_free with overwrite) is removed first; a resumed run keeps what is there."""
        if fresh and self.is_run():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(exist_ok=True)
        return self


def new_run_folder(root: str | Path, name: str, overwrite: bool = False) -> tuple[RunFolder, str]:
    """The folder of a new run called `name` under `root` ("auto": run-YYYYmmdd-HHMMSS), and a
    sentence when it is not root/name: a name already taken (a folder holding a run, or anything
    else) gives the first free name-2, name-3, ..., so a fixed output.run_name in a loaded config
    trains every time instead of failing every later Train; `overwrite` (output.overwrite) reuses
    a run's folder, as it always did. The one rule for a new run's folder (the session, and the
    callers that fix the folder before starting processes under torchrun)."""
    root = Path(root).expanduser()
    if name == "auto":
        name = datetime.now().strftime("run-%Y%m%d-%H%M%S")
    why = checks.run_name_problem(name)
    if why:
        raise RunFolderError(f"output.run_name: {why}")
    first = RunFolder(root / name)
    if not checks.taken(first.path) or (overwrite and first.is_run()):
        return first, ""
    n = 2
    while checks.taken(root / f"{name}-{n}"):
        n += 1
    folder = RunFolder(root / f"{name}-{n}")
    what = "holds a run" if first.is_run() else "is in the way"
    return folder, f"{first.path} already {what}: this run is {folder.path.name}"
