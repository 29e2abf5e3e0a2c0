"""Train pressed the moment the window appears (issue 28, item 2): the run used to import
transformers beside the warm-up task and fail with "cannot import name 'AutoTokenizer'", or the
Data page showed "module 'transformers' has no attribute 'PreTrainedTokenizerBase'". Train must
wait for the warm-up imports (or do them) instead.

In a child process: only a fresh interpreter has the imports still to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_process import child_env

CHILD = """
import sys
from pathlib import Path
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from studio.main_window import MainWindow
from studio.settings import Settings
sys.path.insert(0, sys.argv[3])
from studio_helpers import short_config
assert "transformers" not in sys.modules
w = MainWindow(Settings(sys.argv[1]), sys.argv[2])
short_config(w.state, Path(sys.argv[2]), "at-once", steps=3)
w.show()
w.start_background()  # what the first paint does: hardware, model report, data preview, warm-up
started = w.start_training()  # at once, with every import still ahead
print("STARTED", started, flush=True)
outcome = []
w.run_finished.connect(lambda e: (outcome.append(e), QTimer.singleShot(0, app.quit)))
QTimer.singleShot(600_000, app.quit)
app.exec()
from studio import tasks
tasks.wait_all(120_000)
event = outcome[0] if outcome else None
print("OUTCOME", type(event).__name__, getattr(event, "message", ""), flush=True)
print("DATA", repr(w.data_panel.problem), flush=True)
print("LOG", w.monitor_panel.log.toPlainText().replace(chr(10), " | ")[-2000:], flush=True)
"""


@pytest.mark.slow  # a window in a child process that trains once its imports are done
def test_train_pressed_at_once_waits_for_the_start_up_imports(tmp_path):
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "s.ini"), str(tmp_path / "runs"), str(here)],
        cwd=tmp_path,
        env=child_env(QT_QPA_PLATFORM="offscreen", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "STARTED True" in out.stdout, out.stdout + out.stderr
    assert "OUTCOME Finished" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "DATA ''" in out.stdout, out.stdout
    assert "cannot import name" not in out.stdout + out.stderr
    assert "has no attribute" not in out.stdout + out.stderr
