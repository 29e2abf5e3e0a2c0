"""Run a plain function off the GUI thread and get its result back as a queued Qt signal.

The shape borrowed from Orange3: heavy work (loading a data set, a tokenizer, a model,
exporting) is an ordinary function; the window hands it to a thread pool and receives
`done(result)` or `failed(message, detail)` on the GUI thread.

Work runs in lanes, one thread each, so one slow job never holds up another kind: an X-ray of
a 354k-row file must not keep the Model page at "(reading config…)" or Chat at "Loading…". A task
started with a `key` supersedes the previous task of that key: a queued one is dropped, a running
one is told to stop (a function that accepts `cancelled=` gets a callable to poll) and its answer,
if it still comes, is thrown away. `shutdown()` does that for every task when the window quits.

Some calls cannot be told to stop: a Hub lookup retrying inside huggingface_hub, a model load in
transformers. Started with `interruptible=False`, such a task is let go when cancelled while it
runs: the page hears `cancelled` at once, its lane gets a fresh thread so the next task does not
queue behind it, and the abandoned call finishes on its old thread with its answer dropped. Quit
never waits for it beyond `shutdown`'s grace (studio.app ends the process with os._exit).

Until the engine's heavy imports are done (studio.warmup), tasks run one at a time whatever their
lane: those libraries cannot be imported from two threads at once.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import traceback
from typing import Any, Callable, Optional

import shiboken6
from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from studio import warmup

# The lanes the window uses (any other name gets a lane of its own on first use).
LANES = ("general", "hardware", "model", "data", "example", "xray", "chat", "runs", "export")


class Cancelled(Exception):
    """Raised by a task's own `cancelled()` check to end it early; reported as cancelled."""


class _Signals(QObject):
    done = Signal(object)
    failed = Signal(str, str)
    progress = Signal(object)
    cancelled = Signal()


class Task(QRunnable):
    """One call of `fn(*args, **kwargs)` on a pool thread; `fn` may accept `progress=` (a
    callable it reports to) and `cancelled=` (a callable answering whether to stop)."""

    def __init__(self, fn: Callable, *args, with_progress: bool = False, **kwargs):
        super().__init__()
        # The pool must not delete the runnable while the signals object is still referenced.
        self.setAutoDelete(False)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.with_progress = with_progress
        self.stop_requested = threading.Event()
        self.lane = "general"
        self.key: Optional[str] = None
        self.interruptible = True  # False: cancelling it while it runs lets it go (see the module)
        self.seq = next(_order)  # the order tasks were started in, kept when a lane is moved
        self.returned = False  # its run() is over (a let-go task may be forgotten then)
        self._ended = threading.Lock()  # done, failed or cancelled is said once
        self._said_end = False
        # Created on the GUI thread, so slots connected to it run there (queued).
        self.signals = _Signals()

    def cancel(self) -> None:
        """Ask the task to stop; whatever it returns afterwards is dropped."""
        self.stop_requested.set()

    def is_cancelled(self) -> bool:
        return self.stop_requested.is_set()

    def run(self) -> None:  # pool thread
        try:
            if self.is_cancelled():
                self._emit("cancelled")
                return
            if warmup.done.is_set():
                self._call()
            else:
                with warmup.gate:
                    self._call()
        finally:
            self.returned = True

    def _call(self) -> None:
        try:
            kwargs = dict(self.kwargs)
            if self.with_progress:
                kwargs["progress"] = lambda value: None if self.is_cancelled() else self._emit("progress", value)
            if _accepts(self.fn, "cancelled"):
                kwargs["cancelled"] = self.is_cancelled
            result = self.fn(*self.args, **kwargs)
        except BaseException as exc:  # report everything: the GUI thread decides what to show
            if self.is_cancelled() or isinstance(exc, Cancelled) or type(exc).__name__ == "Cancelled":
                self._emit("cancelled")
            else:
                self._emit("failed", readable_error(exc), traceback.format_exc())
        else:
            if self.is_cancelled():
                self._emit("cancelled")
            else:
                self._emit("done", result)

    def _emit(self, name: str, *args) -> None:
        """Emit unless the signals object is gone: a task still running when the application
        exits finds it deleted ("Signal source has been deleted"), and nobody is left to tell.
        The end (done, failed or cancelled) is said once: a task let go said cancelled already."""
        if name != "progress":
            with self._ended:
                if self._said_end:
                    return
                self._said_end = True
        try:
            getattr(self.signals, name).emit(*args)
        except RuntimeError:
            if shiboken6.isValid(self.signals):
                raise


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return False


_running: set[Task] = set()
_by_key: dict[str, Task] = {}
_pools: dict[str, QThreadPool] = {}
# Tasks let go while running (kept alive until their thread returns) and the pools that still run
# them (a pool deleted with a running thread would wait for it).
_abandoned: set[Task] = set()
_order = itertools.count()
_retired: list[QThreadPool] = []
_lock = threading.Lock()


def pool(lane: str = "general") -> QThreadPool:
    """The lane's pool: one thread, so a lane's tasks run one after another (a data set's rows
    before its example), while lanes run beside each other."""
    with _lock:
        p = _pools.get(lane)
        if p is None:
            p = QThreadPool()
            p.setMaxThreadCount(1)
            p.setObjectName(f"tunesmith-{lane}")
            _pools[lane] = p
        return p


def _guarded(owner: Optional[QObject], fn: Optional[Callable]) -> Optional[Callable]:
    """Call `fn` only while `owner` (the widget that asked) still exists: a result can arrive
    after its window closed, and must then be dropped rather than touch deleted widgets."""
    if fn is None or owner is None:
        return fn

    def call(*args):
        if shiboken6.isValid(owner):
            fn(*args)

    return call


def _unless_cancelled(task: Task, fn: Optional[Callable]) -> Optional[Callable]:
    """A cancelled task's late answer is dropped on the GUI thread too (it may have been emitted
    just before cancel() was called)."""
    if fn is None:
        return None

    def call(*args):
        if not task.is_cancelled():
            fn(*args)

    return call


def run_task(
    fn: Callable,
    *args,
    owner: Optional[QObject] = None,
    on_done: Optional[Callable[[Any], None]] = None,
    on_error: Optional[Callable[[str, str], None]] = None,
    on_progress: Optional[Callable[[Any], None]] = None,
    on_cancelled: Optional[Callable[[], None]] = None,
    lane: str = "general",
    key: Optional[str] = None,
    interruptible: bool = True,
    **kwargs,
) -> Task:
    """Start `fn(*args, **kwargs)` in `lane`; with `key`, first cancel the previous task of that key.
    `interruptible=False`: a call that cannot be stopped, let go when cancelled (see the module)."""
    on_done, on_error, on_progress, on_cancelled = (
        _guarded(owner, f) for f in (on_done, on_error, on_progress, on_cancelled)
    )
    task = Task(fn, *args, with_progress=on_progress is not None, **kwargs)
    task.lane, task.key, task.interruptible = lane, key, interruptible
    if key is not None:
        cancel(key)
        _by_key[key] = task
    # Keep a strong reference until the result is delivered; otherwise Python may collect
    # the signals object while the pool thread still emits on it.
    _running.add(task)

    def finish(*_):
        _running.discard(task)
        if key is not None and _by_key.get(key) is task:
            del _by_key[key]

    for signal, slot in (
        (task.signals.done, _unless_cancelled(task, on_done)),
        (task.signals.failed, _unless_cancelled(task, on_error)),
        (task.signals.progress, _unless_cancelled(task, on_progress)),
        (task.signals.cancelled, on_cancelled),
    ):
        if slot is not None:
            signal.connect(slot)
    for signal in (task.signals.done, task.signals.failed, task.signals.cancelled):
        signal.connect(finish)
    pool(lane).start(task)
    return task


def _drop(task: Task) -> None:
    """Cancel `task`; one still queued leaves its pool at once and says so, one running that
    cannot be interrupted is let go (its lane gets a fresh thread) and says so too."""
    task.cancel()
    if pool(task.lane).tryTake(task):
        task._emit("cancelled")
    elif not task.interruptible and not task.returned:
        _let_go(task)


def _let_go(task: Task) -> None:
    """`task` runs a call that cannot be stopped: keep it alive until its thread returns, give its
    lane a fresh pool (with the tasks queued behind it, in order) and say cancelled now."""
    _abandoned.difference_update([t for t in _abandoned if t.returned])
    _abandoned.add(task)
    with _lock:
        old = _pools.pop(task.lane, None)
        _retired[:] = [p for p in _retired if p.activeThreadCount() > 0]
        if old is not None:
            _retired.append(old)
    if old is not None:
        behind = sorted((t for t in _running if t.lane == task.lane and t is not task), key=lambda t: t.seq)
        for t in behind:
            if old.tryTake(t):
                pool(task.lane).start(t)
    task._emit("cancelled")


def cancel(key: str) -> bool:
    """Cancel the task started with `key`, if one is queued or running; True when there was one."""
    task = _by_key.pop(key, None)
    if task is None:
        return False
    _drop(task)
    return True


def pending(key: str) -> bool:
    return key in _by_key


def busy() -> bool:
    return bool(_running)


def shutdown(timeout_ms: int = 3000) -> bool:
    """The window is quitting: cancel every task and wait up to `timeout_ms` for the lanes to
    empty. False when some task did not stop in time (the caller ends the process anyway)."""
    every = sorted(_running, key=lambda t: t.seq)
    for task in every:  # first, so a task moved to a fresh lane by a let-go one does not start
        task.cancel()
    for task in every:
        _drop(task)
    _by_key.clear()
    return wait_all(timeout_ms)


def wait_all(timeout_ms: int = 60_000) -> bool:
    """Wait for every lane to finish what it holds (tests, and shutdown)."""
    import time

    deadline = time.monotonic() + timeout_ms / 1000
    with _lock:
        pools = list(_pools.values()) + list(_retired)
    for p in pools:
        left = max(0, int((deadline - time.monotonic()) * 1000))
        if not p.waitForDone(left):
            return False
    return True


def readable_error(exc: BaseException) -> str:
    """One line a person can read: the exception's own message, not its class path."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, MemoryError):
        return "Out of memory: " + text
    if isinstance(exc, FileNotFoundError) and getattr(exc, "filename", None):
        return f"File not found: {exc.filename}"
    return text
