"""Run a plain function off the GUI thread and get its result back as a queued Qt signal.

The shape borrowed from Orange3: heavy work (loading a data set, a tokenizer, a model,
exporting) is an ordinary function; the window hands it to a thread pool and receives
`done(result)` or `failed(message, detail)` on the GUI thread. Nothing here knows the engine.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import shiboken6
from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal


class _Signals(QObject):
    done = Signal(object)
    failed = Signal(str, str)
    progress = Signal(object)


class Task(QRunnable):
    """One call of `fn(*args, **kwargs)` on a pool thread; `fn` may accept `progress=`."""

    def __init__(self, fn: Callable, *args, with_progress: bool = False, **kwargs):
        super().__init__()
        # The pool must not delete the runnable while the signals object is still referenced.
        self.setAutoDelete(False)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.with_progress = with_progress
        # Created on the GUI thread, so slots connected to it run there (queued).
        self.signals = _Signals()

    def run(self) -> None:  # pool thread
        try:
            kwargs = dict(self.kwargs)
            if self.with_progress:
                kwargs["progress"] = lambda value: self._emit("progress", value)
            result = self.fn(*self.args, **kwargs)
        except BaseException as exc:  # report everything: the GUI thread decides what to show
            self._emit("failed", readable_error(exc), traceback.format_exc())
        else:
            self._emit("done", result)

    def _emit(self, name: str, *args) -> None:
        """Emit unless the signals object is gone: a task still running when the application
        exits finds it deleted ("Signal source has been deleted"), and nobody is left to tell."""
        try:
            getattr(self.signals, name).emit(*args)
        except RuntimeError:
            if shiboken6.isValid(self.signals):
                raise


_running: set[Task] = set()
_pool: Optional[QThreadPool] = None


def pool() -> QThreadPool:
    """One background thread, so tasks run one after another.

    Serial on purpose: the first tasks import torch, transformers and datasets, and those
    libraries are not safe to import from two threads at once (datasets probing a half-imported
    transformers fails with "module 'transformers' has no attribute ..."). The training run
    has its own thread (studio.worker) and never waits in this queue.
    """
    global _pool
    if _pool is None:
        _pool = QThreadPool()
        _pool.setMaxThreadCount(1)
        _pool.setObjectName("tunesmith-tasks")
    return _pool


def _guarded(owner: Optional[QObject], fn: Optional[Callable]) -> Optional[Callable]:
    """Call `fn` only while `owner` (the widget that asked) still exists: a result can arrive
    after its window closed, and must then be dropped rather than touch deleted widgets."""
    if fn is None or owner is None:
        return fn

    def call(*args):
        if shiboken6.isValid(owner):
            fn(*args)

    return call


def run_task(
    fn: Callable,
    *args,
    owner: Optional[QObject] = None,
    on_done: Optional[Callable[[Any], None]] = None,
    on_error: Optional[Callable[[str, str], None]] = None,
    on_progress: Optional[Callable[[Any], None]] = None,
    **kwargs,
) -> Task:
    on_done, on_error, on_progress = (_guarded(owner, f) for f in (on_done, on_error, on_progress))
    task = Task(fn, *args, with_progress=on_progress is not None, **kwargs)
    # Keep a strong reference until the result is delivered; otherwise Python may collect
    # the signals object while the pool thread still emits on it.
    _running.add(task)

    def finish(_=None, *__):
        _running.discard(task)

    if on_done:
        task.signals.done.connect(on_done)
    if on_error:
        task.signals.failed.connect(on_error)
    if on_progress:
        task.signals.progress.connect(on_progress)
    task.signals.done.connect(finish)
    task.signals.failed.connect(finish)
    pool().start(task)
    return task


def busy() -> bool:
    return bool(_running)


def readable_error(exc: BaseException) -> str:
    """One line a person can read: the exception's own message, not its class path."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, MemoryError):
        return "Out of memory: " + text
    if isinstance(exc, FileNotFoundError) and getattr(exc, "filename", None):
        return f"File not found: {exc.filename}"
    return text
