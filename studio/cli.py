"""The `tunesmith` console command: no subcommand opens the window, any subcommand runs headless.

It imports no Qt itself, so `tunesmith train ...` works on a machine without a display.
"""

from __future__ import annotations

import sys

# Commands this module runs itself, beside the engine's headless ones: `tunesmith --help` and a
# mistyped command's error list them all.
OWN_COMMANDS = (
    ("studio", "open the window (the same as no command; options: tunesmith studio --help)"),
    ("doctor", "check what a run needs on this machine, with the command that fixes each missing piece"),
    ("install-desktop", "put a `tunesmith` launcher in ~/.local/bin and the app in the desktop's menu"),
    ("uninstall-desktop", "remove exactly what install-desktop wrote (runs stay)"),
)
DESCRIPTION = "Fast LoRA / QLoRA fine-tuning. Without a command, `tunesmith` opens the studio window."
# Options of the console command itself, not the window's.
_OWN_OPTIONS = ("-h", "--help", "--version")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("studio", "gui") or (argv[0].startswith("-") and argv[0] not in _OWN_OPTIONS):
        # No subcommand (window options like --runs-dir go to the window).
        from studio.app import main as app_main

        return app_main(argv[1:] if argv and argv[0] in ("studio", "gui") else argv)
    if argv[0] == "doctor":  # the engine's checks plus the Qt libraries' (studio.doctor)
        from studio.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[0] in ("install-desktop", "uninstall-desktop"):  # the launcher and the menu entry
        from studio.desktop_entry import main as desktop_main

        return desktop_main(argv)
    from engine.api import cli_main

    return cli_main(argv, OWN_COMMANDS, DESCRIPTION)


if __name__ == "__main__":
    raise SystemExit(main())
