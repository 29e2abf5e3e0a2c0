"""The `tunesmith` console command: no subcommand opens the window, any subcommand runs headless.

It imports no Qt itself, so `tunesmith train ...` works on a machine without a display.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("studio", "gui"):
        from studio.app import main as app_main

        return app_main(argv[1:])
    from engine.cli import main as engine_main

    return engine_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
