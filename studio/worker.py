"""Runs one `engine.api.TrainingSession` on a QThread and turns its events into
queued Qt signals.

The session's `run()` blocks its thread until the run finishes, fails or stops, so pause,
resume and stop do not travel through that thread's event loop: they call the session's
thread-safe `request_*` methods directly from the GUI thread. A request that arrives before
the session exists is remembered and applied as soon as it does.

`probe(prompt)` (the Chat page's "Talk to step N (paused)") runs the paused session's model on
the calling thread, which must be a pool thread, never the GUI thread: the session thread is
blocked in its pause, and the session's lock keeps it there until the probe is done.
"""

from __future__ import annotations

import threading
import traceback
from typing import Optional

from PySide6.QtCore import QObject, QThread, Signal, Slot


class TrainingWorker(QObject):
    event = Signal(object)  # an engine.events.Event, delivered on the GUI thread
    finished = Signal()  # run() returned, whatever the outcome

    def __init__(self, config, run_dir: Optional[str] = None, resume_from: Optional[str] = None):
        super().__init__()
        self._config = config
        self._run_dir = run_dir
        self._resume_from = resume_from
        self._session = None
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._pause_asked = False  # the last request was a pause (closing the window asks it)
        self.thread = QThread()
        self.thread.setObjectName("tunesmith-training")
        self.moveToThread(self.thread)
        self.thread.started.connect(self.run)

    def start(self) -> None:
        self.thread.start()

    @Slot()
    def run(self) -> None:  # worker thread
        try:
            from studio.warmup import ensure_warm

            # Train pressed a second after the window appeared must not import transformers
            # beside the warm-up task ("cannot import name 'AutoTokenizer'"): wait for it, or do it.
            ensure_warm()
            from engine.api import LogLine, TrainingSession, apply_cpu_threads

            # Sized per run, here where the run starts: on a CPU, one core stays with the window.
            threads = apply_cpu_threads(self._config.training.device)
            if threads is not None:
                self.event.emit(LogLine(message=f"torch uses {threads.reason}"))

            # Emitting from this thread queues delivery to the GUI thread's receivers.
            session = TrainingSession(
                self._config, self.event.emit, run_dir=self._run_dir, resume_from=self._resume_from
            )
            with self._lock:
                self._session = session
                pending, self._pending = self._pending, []
            for request in pending:
                getattr(session, request)()
            session.run()
        except BaseException as exc:  # run() reports bad input itself; this is a last resort
            from engine.api import Failed

            self.event.emit(Failed(message=f"The training session could not run: {exc}", detail=traceback.format_exc()))
        finally:
            self.finished.emit()
            # Called directly, not through a queued signal: the GUI thread may be blocked in
            # wait() (closing the window), and QThread.quit is thread-safe.
            self.thread.quit()

    def _request(self, name: str) -> None:
        with self._lock:
            if self._session is None:
                self._pending.append(name)
                return
            session = self._session
        getattr(session, name)()

    def pause(self) -> None:
        self._pause_asked = True
        self._request("request_pause")

    def resume(self) -> None:
        self._pause_asked = False
        self._request("request_resume")

    @property
    def pause_asked(self) -> bool:
        """Pause was the last request (the run is paused, or will be after its current step)."""
        return self._pause_asked

    def stop(self) -> None:
        self._request("request_stop")

    def probe(self, prompt: str, max_new_tokens: int = 64) -> tuple[int, str]:
        """(step, reply) of the paused run's current weights; engine.api.ProbeUnavailable when
        the run is not paused. Blocks: call it from a pool thread (studio.tasks.run_task)."""
        with self._lock:
            session = self._session
        if session is None:
            from engine.api import ProbeUnavailable

            raise ProbeUnavailable("The run has not started yet.")
        return session.probe(prompt, max_new_tokens)

    def is_running(self) -> bool:
        return self.thread.isRunning()

    def wait(self, ms: int = -1) -> bool:
        return self.thread.wait() if ms < 0 else self.thread.wait(ms)
