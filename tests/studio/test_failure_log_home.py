"""A run that fails before it made a folder of its own: the window writes the traceback to the
file engine.runs names for it (failure_log, in the runs folder), and Details opens that file."""

from __future__ import annotations

from pathlib import Path

from engine import api


def test_a_failure_without_a_run_folder_goes_to_the_runs_folders_failure_log(window, runs_dir):
    (runs_dir / "unrelated").mkdir()  # a folder that is no run is not taken for the failed run
    window._on_event(api.Failed(message="The data could not be read.", detail="Traceback (most recent call last): x"))
    path = Path(window.monitor_panel.details_path)
    expected = api.failure_log(runs_dir)
    assert path.parent == runs_dir and path.name.startswith("failed-") and path.suffixes == expected.suffixes
    assert "Traceback (most recent call last): x" in path.read_text(encoding="utf-8")
    assert "Details" in window.monitor_panel.status.text()
