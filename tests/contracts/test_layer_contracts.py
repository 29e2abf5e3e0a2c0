"""The layer contracts in pyproject.toml ([tool.importlinter]) hold on the tree, and catch a
violation: a copy of the packages with one forbidden import added fails `lint-imports`.

scripts/run-tests.sh runs `lint-imports` on the real tree before pytest; these tests prove the
check is not vacuous (a contract that names a module that does not exist, or a tool that finds
no imports, would pass everything).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under `tree` (importable from there, first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # The environment's own lint-imports (next to this interpreter): the test command runs
    # .venv/bin/python without putting .venv/bin on PATH.
    exe = shutil.which("lint-imports", path=sysconfig.get_path("scripts")) or shutil.which("lint-imports")
    assert exe, "lint-imports is not installed (pip install -e '.[test]')"
    return subprocess.run(
        [exe, "--no-cache", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture()
def tree(tmp_path):
    """A copy of the three packages and the contracts, without resources or tests."""
    for name in ("engine", "studio", "bench"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(path: Path, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(text + f"\n{line}  # added by the contract test\n", encoding="utf-8")


def test_the_tree_keeps_every_contract(tree):
    out = _lint(tree)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" not in out.stdout.lower().replace("0 broken", "")


@pytest.mark.parametrize(
    "module,line,contract",
    [
        ("engine/config.py", "import PySide6.QtCore", "The engine never imports Qt"),
        ("engine/fastpath/packed.py", "import engine.train.session", "Layers"),
        ("studio/app.py", "import engine.train.session", "only through engine.api"),
        ("engine/train/optim.py", "import bench.report", "Nothing shipped imports the benchmark"),
        ("engine/train/objectives/sft.py", "import engine.train.session", "Training objectives are parts"),
        ("engine/train/objectives/dpo.py", "import studio.app", "Training objectives are parts"),
        ("engine/config.py", "import engine.train.step", "Leaves: config, events, runs and counters"),
        ("engine/events.py", "import engine.fastpath.lora_group", "Leaves: config, events, runs and counters"),
        ("engine/allocator.py", "import engine.api", "Leaves: config, events, runs and counters"),
        ("engine/runs/history.py", "import engine.train.checkpoint", "Leaves: config, events, runs and counters"),
        ("engine/counters.py", "import engine.fastpath.lora_group", "Leaves: config, events, runs and counters"),
        ("engine/models/arch/llama.py", "import torch", "Architecture files are plain data"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tree, module, line, contract):
    _add_import(tree / module, line)
    out = _lint(tree)
    assert out.returncode != 0, out.stdout[-3000:]
    broken = out.stdout[out.stdout.find("Broken contracts") :]
    assert contract in broken, out.stdout[-3000:]
