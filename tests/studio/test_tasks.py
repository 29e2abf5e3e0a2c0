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


def test_a_task_that_outlives_its_signals_ends_quietly(qtbot):
    import shiboken6

    from studio.tasks import Task

    task = Task(lambda progress: progress(0.5) or 42, with_progress=True)
    shiboken6.delete(task.signals)  # what application exit does to it
    task.run()  # the progress, the result: nowhere to go, and no error
