"""The window and the runs folder (issue 28 item 7): a read-only runs folder is said on the Train
page before Train is pressed, and pressing it only raises the banner (no run, nothing loaded); a
fixed run name trains again and again, the second run beside the first (each later Train failed,
leaving a failed-*.log.txt)."""

from __future__ import annotations

import json
import subprocess
import sys

from child_process import child_env
from studio_helpers import short_config
from unwritable import ordinary_user_prefix

# The window in a child process: as root the permission bits bind only without the DAC override.
CHILD = """
import json, sys
from PySide6.QtWidgets import QApplication
app = QApplication([])
from studio.main_window import MainWindow
from studio.settings import Settings
w = MainWindow(Settings(sys.argv[1]), sys.argv[2])
w.show(); app.processEvents()
tp = w.training_panel
seen = {"enabled": tp.train.isEnabled(), "reason": tp.train_reason.text(), "menu": w.train_action.isEnabled()}
seen["started"] = w.start_training()
seen["banner"] = tp.banner.label.text() if tp.banner.isVisible() else ""
seen["worker"] = w.worker is not None
w.state.set("output.dir", sys.argv[3])  # another runs folder: Train is offered again
app.processEvents()
seen["after"] = {"enabled": tp.train.isEnabled(), "reason": tp.train_reason.text()}
print("SEEN " + json.dumps(seen), flush=True)
"""


def test_a_read_only_runs_folder_closes_the_train_gate_with_a_sentence(tmp_path):
    prefix = ordinary_user_prefix()
    locked, other = tmp_path / "runs", tmp_path / "other"
    locked.mkdir()
    other.mkdir()
    locked.chmod(0o555)
    try:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", CHILD, str(tmp_path / "s.ini"), str(locked), str(other)],
            capture_output=True,
            text=True,
            timeout=300,
            env=child_env(QT_QPA_PLATFORM="offscreen"),
            cwd=tmp_path,
        )
    finally:
        locked.chmod(0o755)
    line = next((x for x in out.stdout.splitlines() if x.startswith("SEEN ")), None)
    assert line is not None, out.stderr[-3000:]
    seen = json.loads(line[5:])
    sentence = f"Runs cannot be saved: {locked} is not writable by you."
    assert not seen["enabled"] and not seen["menu"] and seen["reason"].startswith(sentence)
    assert "output.dir" in seen["reason"]
    assert not seen["started"] and not seen["worker"] and seen["banner"].startswith(sentence)
    assert seen["after"] == {"enabled": True, "reason": ""}
    assert list(locked.iterdir()) == []


def test_a_fixed_run_name_trains_twice_in_the_window(window, qtbot, runs_dir):
    short_config(window.state, runs_dir, "fixed", steps=2)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=300_000)
    outcomes = []
    for _ in range(2):
        with qtbot.waitSignal(window.run_finished, timeout=300_000) as done:
            assert window.start_training()
        outcomes.append(done.args[0])
    assert [type(e).__name__ for e in outcomes] == ["Finished", "Finished"], [
        getattr(e, "message", e) for e in outcomes
    ]
    assert [e.run_dir for e in outcomes] == [str(runs_dir / "fixed"), str(runs_dir / "fixed-2")]
    assert f"{runs_dir / 'fixed'} already holds a run: this run is fixed-2" in window.monitor_panel.log.toPlainText()
    assert sorted(p.name for p in runs_dir.iterdir()) == ["fixed", "fixed-2"]  # no failed-*.log.txt
