"""Quit ends the process, always (issue 28: Ctrl+Q hid the window while an
X-ray or an offline Hub lookup kept the process alive for minutes at 40% CPU).

Run in a child process: what is measured is the process itself ending."""

from __future__ import annotations

from child_process import end_after_quit

# A child that opens the window, starts a task that will not listen (a stand-in for a Hub lookup
# retrying offline: it ignores `cancelled`) and one that does, waits until both run, then quits
# the way studio.app.main does after the event loop.
CHILD = """
import sys, threading
from PySide6.QtWidgets import QApplication
app = QApplication([])
from studio.main_window import MainWindow
from studio.settings import Settings
from studio import app as studio_app, tasks, warmup
w = MainWindow(Settings(sys.argv[1]), sys.argv[2])
w.show(); app.processEvents()
warmup.ensure_warm()
deaf, listening = threading.Event(), threading.Event()
def hub_lookup():
    deaf.set()
    threading.Event().wait(600)
def scan(cancelled):
    listening.set()
    while not cancelled():
        threading.Event().wait(0.01)
tasks.run_task(hub_lookup, lane="hub")
tasks.run_task(scan, lane="xray")
assert deaf.wait(60) and listening.wait(60)
w.close(); app.processEvents()
print("QUITTING", flush=True)
raise SystemExit(studio_app.finish(0, grace_ms=2000))
"""


def test_quit_ends_the_process_with_a_task_that_does_not_listen(tmp_path):
    code, err, tore_down = end_after_quit(CHILD, [str(tmp_path / "s.ini"), str(tmp_path / "runs")], tmp_path)
    assert code == 0, err
    assert "abandoned" in err  # it left the deaf task behind and said so, rather than wait for it
    assert not tore_down, "the process ended through Python's teardown (seconds with torch loaded), not finish's exit"
