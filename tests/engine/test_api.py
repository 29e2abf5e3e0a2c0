"""engine.api: the one door studio/ and the CLI use. Importing it stays light (no torch), every
name it promises resolves, docs/ENGINE_API.md's first section lists exactly those names, and
the studio imports nothing else of the engine."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "datasets", "peft", "triton", "PySide6")


def test_importing_the_api_imports_no_torch():
    code = f"import json, sys\nimport engine.api\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_name_resolves():
    import engine.api as api

    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    from engine.train.session import TrainingSession

    assert api.TrainingSession is TrainingSession  # the lazy name is the real class


def _documented_names() -> list[str]:
    text = (ROOT / "docs" / "ENGINE_API.md").read_text(encoding="utf-8")
    first = text.split("\n## ", 2)[1]  # the first "## " section
    names = []
    for line in first.splitlines():
        if line.startswith("Names:"):
            names += re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", line)
    return names


def test_engine_api_doc_lists_exactly_the_api():
    import engine.api as api

    documented = _documented_names()
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert set(documented) == set(api.__all__), (
        f"only in the doc: {sorted(set(documented) - set(api.__all__))}; "
        f"only in engine/api.py: {sorted(set(api.__all__) - set(documented))}"
    )


def _engine_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            found.append(node.module if node.module != "engine" else "engine." + ",".join(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "engine"]
    return found


def test_studio_and_cli_import_only_engine_api():
    bad = []
    for path in sorted((ROOT / "studio").rglob("*.py")) + [ROOT / "engine" / "cli.py"]:
        for module in _engine_imports(path):
            if module != "engine.api":
                bad.append(f"{path.relative_to(ROOT)}: {module}")
    assert not bad, bad


def test_data_never_loads_a_model():
    from engine.data import preview

    assert not hasattr(preview, "load_tokenizer")
    for path in sorted((ROOT / "engine" / "data").rglob("*.py")):
        for module in _engine_imports(path):
            assert not module.startswith(("engine.models", "engine.train")), f"{path.name} imports {module}"
