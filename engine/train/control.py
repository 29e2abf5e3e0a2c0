"""Run control: pause, resume and stop, requested from any thread and honoured by the session
between optimizer steps; the control file through which the window steers a run under torchrun;
and the lock a live probe of a paused run shares with the loop.

Rank 0 reads the requests and waits; under torchrun the other ranks learn its decision through
`DistContext.agree`, so every rank stops at the same step.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Optional

from engine.events import Paused, Resumed


class RunControl:
    """The requests (thread-safe) and the waits that honour them.

    `emit(event)` and `log(message, level)` report (the session's reporter). `paused_at`: the
    step the loop is paused after, set only while it waits in `wait_if_paused`; `probe_lock` is
    held by a probe while it runs the model and by the loop before it leaves a pause, so the two
    never use the model at once."""

    def __init__(self, emit: Callable, log: Callable):
        self._emit, self._log = emit, log
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self.probe_lock = threading.Lock()
        self.paused_at: Optional[int] = None

    # -- requests (any thread) ------------------------------------------------------------------
    def request_pause(self) -> None:
        self._resume.clear()

    def request_resume(self) -> None:
        self._resume.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._resume.set()  # a paused run must wake up to stop

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_for_resume(self, seconds: Optional[float]) -> bool:
        """True once resumed (or stopped); False when `seconds` passed first."""
        return self._resume.wait(seconds)

    # -- honoured by the loop -------------------------------------------------------------------
    def wait_if_paused(self, step: int, dist, run_dir: Optional[Path]) -> bool:
        """Blocks while paused; True when the run is to stop. Several processes: rank 0 reads
        the window's control file and waits; the others learn its decision in `agree`."""
        if dist.enabled and dist.is_main:
            self.read_control(run_dir)
        if dist.is_main and not self._resume.is_set():
            with self.probe_lock:  # before Paused is reported: a probe may follow at once
                self.paused_at = step
            self._emit(Paused(step))
            self._log(f"Paused at step {step}")
            while not self._resume.wait(0.5 if dist.enabled else None):
                self.read_control(run_dir)
            with self.probe_lock:  # a probe in flight finishes before the model trains again
                self.paused_at = None
            if not self._stop.is_set():
                self._emit(Resumed(step))
                self._log(f"Resumed at step {step}")
        _, stop = dist.agree(False, self._stop.is_set())
        return stop

    def pause_for(self, step: int, message: str, room: Callable[[], bool], poll_seconds: float) -> bool:
        """Pause at `step` for a reason the run can see end by itself (a full disk): Paused with
        the reason, then wait until `room()` says so (looked at every `poll_seconds`) or the
        person resumes. False when the run is to stop instead."""
        self._resume.clear()
        self._emit(Paused(step, reason=message))
        while not self._resume.wait(poll_seconds):
            if room():
                self._resume.set()
        if self._stop.is_set():
            return False
        self._emit(Resumed(step))
        self._log(f"Resumed at step {step}")
        return True

    def read_control(self, run_dir: Optional[Path]) -> None:
        """The window's request for a run under torchrun (a file in the run folder)."""
        if run_dir is None:
            return
        from engine.runs import RunFolder
        from engine.train.distributed import read_control

        request = read_control(RunFolder(run_dir).control_file)
        if request == "pause":
            self.request_pause()
        elif request == "resume":
            self.request_resume()
        elif request == "stop":
            self.request_stop()
