"""studio.tasks: a background task reports on the GUI thread, and one still running when the
application exits (its signals object already deleted) ends quietly instead of printing
"Signal source has been deleted" from the pool thread."""

from __future__ import annotations


def test_a_task_reports_its_result_and_its_error(qtbot):
    from studio.tasks import Task

    task = Task(lambda: 42)
    with qtbot.waitSignal(task.signals.done) as done:
        task.run()
    assert done.args == [42]

    def fails():
        raise ValueError("row 3: no 'text' field")

    task = Task(fails)
    with qtbot.waitSignal(task.signals.failed) as failed:
        task.run()
    assert "row 3: no 'text' field" in failed.args[0] and "ValueError" in failed.args[1]


def _warm():
    """Lanes run beside each other only once the engine's imports are done (studio.warmup)."""
    from studio.warmup import ensure_warm

    ensure_warm()


def test_a_slow_task_in_one_lane_does_not_hold_up_another_lane(qtbot):
    """Issue 28: an X-ray of a big file kept the Model page at "(reading config…)" and Chat at
    "Loading…" for minutes, because every task waited in one queue."""
    import threading

    from studio.tasks import run_task, wait_all

    _warm()
    release = threading.Event()
    slow_result, quick_result = [], []
    run_task(lambda: release.wait(60) and "slow", lane="xray", on_done=slow_result.append)
    run_task(lambda: "model report", lane="model", on_done=quick_result.append)
    qtbot.waitUntil(lambda: quick_result == ["model report"], timeout=10_000)
    assert slow_result == []  # the slow one is still running: the quick one did not wait for it
    release.set()
    qtbot.waitUntil(lambda: slow_result == ["slow"], timeout=10_000)
    assert wait_all(10_000)


def test_a_task_superseded_by_its_key_is_stopped_and_its_answer_dropped(qtbot):
    """A page never shows a stale answer: the second request of a key cancels the first (queued:
    dropped; running: told to stop through `cancelled`), and only the second one's result lands."""
    import threading

    from studio.tasks import run_task, wait_all

    _warm()
    started = threading.Event()
    results, cancelled_seen = [], []

    def scan(name, cancelled):
        started.set()
        while not cancelled():
            threading.Event().wait(0.01)  # a batch of rows
        return name  # answered anyway, after being told to stop: must be dropped

    first = run_task(
        scan,
        "first",
        lane="xray",
        key="data.xray",
        on_done=results.append,
        on_cancelled=lambda: cancelled_seen.append("first"),
    )
    assert started.wait(10)
    queued = run_task(
        scan,
        "queued",
        lane="xray",
        key="data.xray",
        on_done=results.append,
        on_cancelled=lambda: cancelled_seen.append("queued"),
    )
    assert first.is_cancelled()
    run_task(lambda: "last", lane="xray", key="data.xray", on_done=results.append)
    assert queued.is_cancelled()
    qtbot.waitUntil(lambda: results == ["last"], timeout=10_000)
    assert sorted(cancelled_seen) == ["first", "queued"]
    assert wait_all(10_000)


def test_shutdown_stops_every_task_that_listens(qtbot):
    """Quit: a whole-file scan still running is told to stop and the lanes empty at once."""
    import threading

    from studio.tasks import busy, run_task, shutdown

    _warm()
    started = threading.Event()

    def scan(cancelled):
        started.set()
        while not cancelled():
            threading.Event().wait(0.01)

    run_task(scan, lane="xray")
    run_task(scan, lane="data")
    assert started.wait(10)
    assert shutdown(10_000)
    qtbot.waitUntil(lambda: not busy(), timeout=10_000)
