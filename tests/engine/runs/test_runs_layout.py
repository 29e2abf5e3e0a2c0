"""engine.runs.layout: the names and paths of a run folder, answered without reading any file; and
the package as a leaf that re-exports its modules' names."""

from __future__ import annotations

import ast
from pathlib import Path

import engine.runs as runs
from engine.runs.layout import RunLayout, failure_log

PACKAGE = Path(runs.__file__).parent


def test_paths_are_names_under_the_folder_and_need_no_folder(tmp_path):
    run = RunLayout(tmp_path / "nothing-here")
    assert not run.path.exists() and not run.is_run() and not run.looks_like_run()
    named = {
        run.config: runs.CONFIG,
        run.metrics: runs.METRICS,
        run.log: runs.LOG,
        run.checkpoints_dir: runs.CHECKPOINTS,
        run.adapter: runs.ADAPTER,
        run.exports_dir: runs.EXPORTS,
        run.export_verdicts: runs.EXPORT_VERDICTS,
        run.best_file: runs.BEST,
        run.gallery_file: runs.GALLERY,
        run.lock_file: runs.LOCK,
        run.tensorboard_dir: runs.TENSORBOARD,
        run.control_file: runs.CONTROL,
    }
    assert all(path == run.path / name for path, name in named.items())
    assert len(set(named.values())) == len(named)  # no two files share a name
    assert run.checkpoint(7) == run.path / runs.CHECKPOINTS / "step-7"
    assert run.checkpoint_tmp(7).name == "step-7" + runs.TMP_SUFFIX
    assert runs.step_of(run.checkpoint(7)) == 7 and runs.step_of(run.checkpoint_tmp(7)) == -1
    assert run.checkpoints() == [] and run.latest_checkpoint() is None and run.final_adapter() is None
    assert run.partials() == []
    assert not tmp_path.joinpath("nothing-here").exists()  # asking made nothing


def test_what_is_left_of_a_run_and_its_partials(tmp_path):
    run = RunLayout(tmp_path / "r")
    run.checkpoint(3).mkdir(parents=True)
    run.checkpoint_tmp(5).mkdir()
    run.adapter_tmp.mkdir()
    assert run.looks_like_run() and not run.is_run()  # checkpoints without a config.yaml
    assert run.checkpoints() == [(3, run.checkpoint(3))]
    assert sorted(run.partials()) == sorted([run.checkpoint_tmp(5), run.adapter_tmp])
    for f in runs.ADAPTER_FILES:
        (run.adapter / f).parent.mkdir(exist_ok=True)
        (run.adapter / f).write_text("x")
    assert run.final_adapter() == run.adapter and runs.is_adapter(run.adapter)
    assert runs.ADAPTER_FILES == (runs.ADAPTER_CONFIG, runs.ADAPTER_WEIGHTS)


def test_failure_log_lies_beside_the_runs_and_ends_in_the_log_name(tmp_path):
    path = failure_log(tmp_path, when=0.0)
    assert path.parent == tmp_path and path.name.startswith("failed-") and path.name.endswith("." + runs.LOG)
    assert path != failure_log(tmp_path, when=86400.0)  # a later failure gets a file of its own


def test_every_exported_name_resolves_and_is_defined_in_a_module_of_the_package():
    for name in runs.__all__:
        value = getattr(runs, name)
        home = getattr(value, "__module__", None)
        assert home is None or home.startswith("engine.runs."), (name, home)
    assert len(set(runs.__all__)) == len(runs.__all__)


def _engine_imports(path: Path) -> list[str]:
    """The engine modules a file imports; `from engine.runs import checks` counts as engine.runs.checks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "engine.runs":
            found += [f"engine.runs.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [m for m in found if m == "engine" or m.startswith("engine.")]


def test_the_package_is_a_leaf_and_its_modules_import_only_those_before_them():
    order = ["layout", "publish", "records", "status", "checks", "history", "folder"]
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules  # a new module takes its place in the order
    for i, name in enumerate(order):
        imports = _engine_imports(PACKAGE / f"{name}.py")
        for imported in imports:
            assert imported.startswith("engine.runs."), f"{name}.py imports {imported}"
            assert order.index(imported.split(".")[2]) < i, f"{name}.py imports {imported}"
    assert "engine.runs.checks" in _engine_imports(PACKAGE / "folder.py")  # the scan sees both forms
    assert all(m.startswith("engine.runs.") for m in _engine_imports(PACKAGE / "__init__.py"))
