"""The small files a run keeps beside its checkpoints, read and written whole: the last line of
metrics.jsonl (its outcome), when the run last wrote, config.yaml as plain data, best.json,
gallery.jsonl, running.lock and the control file. Each reader returns a plain value, or None / [] / a sentence for
a file that is missing or cannot be read: a broken run folder never raises here."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Optional

from engine.runs.layout import BEST, CONFIG, TMP_SUFFIX, RunLayout, tmp_for


def last_event(run: RunLayout) -> Optional[dict]:
    """The last line of metrics.jsonl as a dict, or None."""
    try:
        with run.metrics.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))  # the tail is enough: the last line is the outcome
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError, IndexError):
        return None


def last_write(run: RunLayout) -> Optional[float]:
    """When the run's own files were last written (metrics.jsonl, log.txt), or None."""
    times = []
    for f in (run.metrics, run.log):
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            pass
    return max(times) if times else None


def read_config(run: RunLayout) -> tuple[dict[str, Any], str]:
    """config.yaml as plain data and "" , or ({}, the problem in one sentence)."""
    import yaml  # only the Runs page's readers need it: `import engine.runs` stays light

    if not run.config.is_file():
        return {}, f"{CONFIG} is missing from {run.path}"
    try:
        data = yaml.safe_load(run.config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"{run.config} cannot be read: {exc}"
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        return {}, f"{run.config} is not valid YAML{where}"
    if not isinstance(data, dict):
        return {}, f"{run.config} holds no settings"
    return data, ""


def read_best(run: RunLayout) -> Optional[dict]:
    """best.json as a dict ({step, eval_loss, checkpoint}), or None."""
    try:
        data = json.loads(run.best_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_best(run: RunLayout, data: dict) -> None:
    """Replace best.json: written whole beside it, then renamed over it."""
    tmp = run.path / (BEST + TMP_SUFFIX)
    tmp.write_text(json.dumps(data, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, run.best_file)


def read_gallery(run: RunLayout) -> list[dict]:
    """[{step, prompt, answer, ...}] from gallery.jsonl; unreadable lines are skipped."""
    try:
        lines = run.gallery_file.read_text(encoding="utf-8", errors="replace").splitlines()
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


def append_gallery(run: RunLayout, records: list[dict]) -> None:
    """Append records, one a line. A line cut short by a kill (a resumed run's file) is ended
    first, so the first new record is not glued to it and lost with it."""
    try:
        with run.gallery_file.open("rb") as f:
            f.seek(-1, 2)
            cut = f.read(1) != b"\n"
    except OSError:  # no file yet, or an empty one
        cut = False
    with run.gallery_file.open("a", encoding="utf-8") as f:
        if cut:
            f.write("\n")
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def write_lock(run: RunLayout, pid: Optional[int] = None) -> None:
    """Mark the run as being trained by `pid` (this process by default): running.lock."""
    info = {"pid": int(pid or os.getpid()), "host": socket.gethostname(), "started": time.time()}
    run.lock_file.write_text(json.dumps(info) + "\n", encoding="utf-8")


def remove_lock(run: RunLayout) -> None:
    try:
        run.lock_file.unlink()
    except FileNotFoundError:
        pass


def locked_by_another_process(run: RunLayout) -> bool:
    """running.lock names a live process that is not this one: another process is training the run
    (a lock of this process is one its own earlier session left, which the next may take over)."""
    if not lock_is_live(run):
        return False
    try:
        info = json.loads(run.lock_file.read_text(encoding="utf-8"))
        return not (int(info["pid"]) == os.getpid() and info.get("host") in (None, socket.gethostname()))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def lock_is_live(run: RunLayout) -> bool:
    """running.lock names a process that is alive (on this machine; a lock from another host is
    taken at its word). A run whose process was killed leaves a lock whose pid is gone: not live."""
    try:
        info = json.loads(run.lock_file.read_text(encoding="utf-8"))
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if info.get("host") not in (None, socket.gethostname()):
        return True
    return _pid_alive(pid)


def write_control(run: RunLayout, request: str) -> None:
    """Replace the control file with the window's `request` ("pause", "resume" or "stop") in one
    rename, so rank 0, reading it between steps, never sees half a word. Raises OSError."""
    tmp = tmp_for(run.control_file)
    tmp.write_text(request, encoding="utf-8")
    os.replace(tmp, run.control_file)


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
