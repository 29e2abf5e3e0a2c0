"""`tunesmith` with no subcommand: open the studio window on the bundled demo model and demo
data set, ready to Train.

Startup is kept short on purpose: Qt, pyqtgraph and the engine's light modules load, the
window is shown, and only then do hardware detection (torch) and data loading start on pool
threads. The time to first paint is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from studio import qt_compat

qt_compat.apply()  # before any Qt call: see studio/qt_compat.py

_T0 = time.perf_counter()


def _process_age() -> float | None:
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil missing or no permission: report only our own timer
        return None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tunesmith", description="Tunesmith Studio: the fine-tuning window.")
    p.add_argument("--runs-dir", help="folder for run folders (default: remembered, else ~/Tunesmith/runs)")
    p.add_argument("--settings", help="an INI file for the studio's settings (default: the system's)")
    p.add_argument(
        "--quit-after-paint", action="store_true", help="open, report time to first paint, exit (smoke test)"
    )
    return p.parse_args(argv)


def load_style() -> str:
    try:
        return (Path(__file__).resolve().parent / "style.qss").read_text(encoding="utf-8")
    except OSError:  # a missing stylesheet must not stop the app
        return ""


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine.api import prefer_expandable_segments

    prefer_expandable_segments()  # the worker thread trains in this process; before CUDA starts
    from studio import system_libs

    libs = system_libs.prepare()  # before QApplication: Qt would abort on a missing xcb library
    if not libs.ok:
        print(libs.message(), file=sys.stderr, flush=True)
        return 1
    from PySide6.QtCore import QEvent, QObject, QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("Tunesmith Studio")
    app.setOrganizationName("Tunesmith")
    app.setStyle("Fusion")
    app.setStyleSheet(load_style())

    from studio.errors import ErrorReporter
    from studio.main_window import MainWindow
    from studio.settings import Settings

    settings = Settings(args.settings)
    window = MainWindow(settings=settings, runs_dir=args.runs_dir)
    reporter = ErrorReporter(window, window.monitor_panel.append_log)
    reporter.install()

    class FirstPaint(QObject):
        def __init__(self):
            super().__init__()
            self.done = False

        def eventFilter(self, obj, event):
            if not self.done and event.type() == QEvent.Type.Paint:
                self.done = True
                ms = (time.perf_counter() - _T0) * 1000
                age = _process_age()
                extra = f", {age * 1000:.0f} ms after the process started" if age is not None else ""
                print(f"tunesmith: window painted {ms:.0f} ms after studio.app loaded{extra}", flush=True)
                if args.quit_after_paint:
                    QTimer.singleShot(0, app.quit)
                else:
                    QTimer.singleShot(0, window.start_background)
            return False

    painter = FirstPaint()
    window.pages.installEventFilter(painter)
    for page in range(window.pages.count()):
        window.pages.widget(page).installEventFilter(painter)
    window.show()
    code = app.exec()
    reporter.uninstall()
    return finish(int(code))


def finish(code: int, grace_ms: int = 1500) -> int:
    """Quit means the process ends within a few seconds, always: every background task is told to
    stop; one that cannot be (a Hub lookup retrying offline, a model load) is left behind, since the
    thread pools' destructors would otherwise wait for it. The process then ends here rather than
    through Python's own teardown, which with torch, transformers and datasets loaded took more
    than 5 s on a busy machine (the walk's Quit step). Settings were synced when the window
    closed; the logs are flushed first."""
    import logging

    from studio import tasks

    if not tasks.shutdown(grace_ms):
        print("tunesmith: background work still running at quit was abandoned", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
