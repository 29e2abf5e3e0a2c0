"""A config file that is not UTF-8, or not YAML, is refused with one sentence naming the file and
line (issue 28, item 6: a traceback in the CLI, a crash dialog in Load config…, raw yaml text)."""

from __future__ import annotations

import pytest

from engine.api import ConfigError, RunConfig, cli_main


def test_a_latin1_config_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  name_or_path: demo\noutput:\n  run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        RunConfig.load(path)
    text = str(err.value)
    assert str(path) in text and "line 4" in text and "UTF-8" in text and "0xe9" in text


def test_a_yaml_syntax_error_is_one_sentence_with_its_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name_or_path: demo\n training: [1, 2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        RunConfig.load(path)
    text = str(err.value)
    assert str(path) in text and "line " in text and "\n" not in text


def test_the_cli_refuses_it_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"output:\n  run_name: caf\xe9\n")
    assert cli_main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not UTF-8" in err
