"""The studio's part of `tunesmith doctor`: the Qt libraries' line, and the command itself.

The engine's checks (engine.doctor, through engine.api) cover Python, the environment, torch, the driver,
Triton, bitsandbytes, llama.cpp and the disk; Qt is the studio's own business (the engine never imports
it), so its line is added here: PySide6 imports, and the system libraries its platform plugin loads are
there (studio.system_libs, which imports no Qt). The Hardware page shows the same list.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib import metadata

from engine.api import DoctorCheck, doctor_checks, doctor_install_fix, doctor_report
from studio import system_libs


def check_qt() -> DoctorCheck:
    try:
        importlib.import_module("PySide6.QtCore")
        version = metadata.version("PySide6")
    except Exception as exc:  # noqa: BLE001 - not installed or a broken wheel
        return DoctorCheck("Qt", "fail", f"PySide6 does not import ({type(exc).__name__}: {exc})", doctor_install_fix())
    libs = system_libs.check()
    if not libs.ok:
        return DoctorCheck(
            "Qt",
            "fail",
            f"PySide6 {version}; its {libs.platform} platform plugin needs {', '.join(libs.missing)} "
            f"(Fedora: {libs.dnf_command})",
            libs.apt_command,
        )
    platform = libs.platform or os.environ.get("QT_QPA_PLATFORM") or sys.platform
    return DoctorCheck("Qt", "ok", f"PySide6 {version}; the libraries of its {platform} platform are here")


def checks(runs_dir=None) -> list[DoctorCheck]:
    return doctor_checks(runs_dir, extra=[check_qt])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tunesmith doctor",
        description="Check what a run needs on this machine; each missing piece comes with the command that fixes it. "
        "Exit status 1 when a run cannot go ahead.",
    )
    p.add_argument("--runs-dir", help="the folder runs are written to (default ~/Tunesmith/runs)")
    args = p.parse_args(argv)
    return doctor_report(checks(args.runs_dir), out=lambda line: print(line, flush=True))
