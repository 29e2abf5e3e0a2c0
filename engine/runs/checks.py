"""Checks before a run is written: may this name be a run's (`run_name_problem`, the one rule
for output.run_name and the Runs page's Rename), can anything be written at this place
(`write_problem`: permissions and free disk), and may a new run start in this folder
(`check_free`). Each answers with one sentence naming the folder and what to do."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from engine.runs.layout import TMP_SUFFIX, RunFolderError, RunLayout

# Below this much free space a run's first checkpoint would not fit (a small model's adapter with
# its optimizer state is tens of MB): refused before anything loads (write_problem).
MIN_FREE_BYTES = 64 * 2**20


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
    free += reclaimable  # room the run frees before it writes (RunLayout.partials)
    if free < MIN_FREE_BYTES:
        return (
            f"Runs cannot be saved: the disk holding {existing} is full ({free / 2**20:.0f} MB free). Free some "
            "space or choose a runs folder on another disk (output.dir), then train again."
        )
    return ""


def check_writable(run: RunLayout, disk_free: Optional[Callable[[Path], int]] = None) -> None:
    """Raise RunFolderError with `write_problem`'s sentence when this run cannot be written:
    before anything loads, not as an OSError after the model and data did. What a write cut
    short left here (`partials`) is removed before anything is written, so its room counts as
    free: a resume after a full disk must not be refused for the space its own debris holds.
    `disk_free`: a test's stand-in for the free-space reading (engine.train.faults)."""
    reclaimable = sum(_size_of(p) for p in run.partials())
    problem = write_problem(run.path, disk_free=disk_free, reclaimable=reclaimable)
    if problem:
        raise RunFolderError(problem)


def check_free(run: RunLayout, overwrite: bool = False, disk_free: Optional[Callable[[Path], int]] = None) -> None:
    """Refuse a folder that already holds a run (unless `overwrite`) or holds anything else,
    a path that is (or lies under) a file, and a place where nothing can be written."""
    for p in (run.path, *run.path.parents):
        if p.exists():
            if not p.is_dir():
                raise RunFolderError(f"the output must be a folder, but {p} is a file")
            break
    check_writable(run, disk_free)
    if run.path.exists() and any(run.path.iterdir()):
        if run.is_run() and not overwrite:
            raise RunFolderError(
                f"the output folder {run.path} already holds a run; choose another run name or "
                "folder, resume it, or set output.overwrite: true"
            )
        if not run.is_run():
            raise RunFolderError(f"the output folder {run.path} is not empty and holds no run; choose an empty folder")


def taken(path: Path) -> bool:
    """Something is at `path` that a new run may not be written into (an empty folder is free)."""
    if not path.exists():
        return False
    return not path.is_dir() or any(path.iterdir())


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
