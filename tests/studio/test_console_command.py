"""The `tunesmith` console command (studio.cli): its help lists every command, the window's and the
set-up ones beside the headless ones, a mistyped command is told the whole list, and --version
answers without opening a window."""

from __future__ import annotations

import pytest

from engine import __version__
from studio.cli import OWN_COMMANDS, main

HEADLESS = ("train", "demo", "export", "chat", "hw")


def _exit(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_help_lists_the_window_doctor_and_desktop_entry_beside_the_headless_commands(capsys):
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0
    assert "Without a command, `tunesmith` opens the studio window." in out.replace("\n", " ")
    for name in HEADLESS + tuple(n for n, _ in OWN_COMMANDS):
        assert f"\n    {name} " in out, name
    assert {n for n, _ in OWN_COMMANDS} == {"studio", "doctor", "install-desktop", "uninstall-desktop"}


def test_a_mistyped_command_is_told_every_command(capsys):
    code, _, err = _exit(["trian"], capsys)
    assert code == 2
    assert "invalid choice: 'trian'" in err
    for name in HEADLESS + ("doctor", "install-desktop"):
        assert f"'{name}'" in err, name


def test_version(capsys):
    code, out, _ = _exit(["--version"], capsys)
    assert code == 0 and out.strip() == f"tunesmith {__version__}"
