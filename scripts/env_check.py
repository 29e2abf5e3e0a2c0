"""Is the project's environment complete? Run by scripts/install.sh with the environment's own interpreter.

Exit 0 when Tunesmith is installed in editable mode from this checkout (an editable install belongs to one
checkout: a moved or second clone must install its own), every requirement of the project and of the asked
extras is installed at a version that satisfies it (engine.doctor.requirement_problems), and the imports
load. Otherwise exit 1 and print what is missing, one item a line, so install.sh installs only when
something is. engine/doctor.py is loaded by its path, so this runs before Tunesmith is installed too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

# Imported, not only looked up: a half-unpacked wheel has metadata but does not import.
IMPORTS = ("torch", "PySide6.QtWidgets", "engine.api", "studio.cli")


def _doctor():
    """engine/doctor.py loaded by its path (standard library at the top): the one list of requirements checks."""
    path = Path(__file__).resolve().parent.parent / "engine" / "doctor.py"
    spec = importlib.util.spec_from_file_location("_tunesmith_doctor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def problems(root: Path, extras: list[str]) -> list[str]:
    found = _doctor().requirement_problems(extras)
    if found:
        return found
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
            found.append(f"{name} (does not import: {type(exc).__name__}: {exc})")
            continue
        if name.split(".")[0] in ("engine", "studio"):
            here = Path(module.__file__).resolve()
            if root.resolve() not in here.parents:
                found.append(f"{name} (installed from {here.parent.parent}, not from this checkout)")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the checkout")
    p.add_argument("--extras", default="", help="comma-separated extras that must be installed")
    args = p.parse_args(argv)
    found = problems(Path(args.root), [e for e in args.extras.split(",") if e])
    for item in found:
        print(item)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
