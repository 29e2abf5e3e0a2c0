"""One rule for a run's name (issue 28 item 10): Rename said only letters, digits, '-', '_' and '.'
were allowed while names with spaces or emoji were accepted, and output.run_name took anything,
'/' included. engine.runs.run_name_problem is the rule; Rename and a new run's folder follow it."""

from __future__ import annotations

import pytest

from engine.runs import RunFolder, RunFolderError, new_run_folder, run_name_problem

GOOD = ["demo", "my run 2", "café-été", "guitar 🎸", "v1.2_final"]
BAD = ["", "  ", ".", "..", "a/b", "a\\b", "tab\there", "line\nbreak", "half.tmp", "x" * 256]


@pytest.mark.parametrize("name", GOOD)
def test_a_folder_name_is_a_run_name_everywhere(tmp_path, name):
    assert run_name_problem(name) == ""
    folder, note = new_run_folder(tmp_path / "runs", name)
    assert folder.path.name == name and note == ""
    src = tmp_path / "old"
    src.mkdir()
    assert RunFolder(src).rename(name).path.name == name


@pytest.mark.parametrize("name", BAD)
def test_a_bad_name_is_refused_the_same_way_by_both(tmp_path, name):
    why = run_name_problem(name)
    assert why
    with pytest.raises(RunFolderError) as new:
        new_run_folder(tmp_path / "runs", name)
    assert why in str(new.value) and "output.run_name" in str(new.value)
    src = tmp_path / "old"
    src.mkdir()
    if name.strip():  # Rename strips the blanks a person typed around a name
        with pytest.raises(RunFolderError) as renamed:
            RunFolder(src).rename(name)
        assert str(renamed.value) == why
    assert src.is_dir() and not (tmp_path / "runs").exists()


def test_the_sentence_does_not_promise_a_narrower_rule():
    why = run_name_problem("a/b")
    assert "cannot be a folder name" in why and "'/'" in why
    assert "letters, digits" not in why
