"""One home per fact: run-folder file names live in engine/runs/ only, the resume decision and
the status rule are the engine's (RunInfo, RunSummary and RunFolder agree), and an export kind
carries its own options, limits and reuse, so that a kind registered by a test goes through the
flow and the CLI that name no kind."""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest

from engine import runs
from engine.export import EXPORTERS, ExportError, ExportKind, ExportOption, check_json, export_and_check
from engine.export.selfcheck import Thresholds
from engine.runs import RunFolder, RunInfo, RunSummary

ROOT = Path(__file__).resolve().parents[2]
# Every file name of a run folder, as engine/runs/ spells it.
RUN_FILE_NAMES = {
    runs.CONFIG,
    runs.METRICS,
    runs.LOG,
    runs.CHECKPOINTS,
    runs.STATE_FILE,
    runs.OPTIMIZER_FILE,
    runs.SCHEDULER_FILE,
    runs.RNG_FILE,
    runs.BEST,
    runs.GALLERY,
    runs.LOCK,
    runs.CONTROL,
    runs.EXPORT_VERDICTS,
    runs.ADAPTER_CONFIG,
    runs.ADAPTER_WEIGHTS,
}


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module but its docstrings (prose may name a file), with its line;
    an f-string's literal parts are constants of their own."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def _names_a_run_file(value: str, tmp_too: bool) -> bool:
    """`value` spells a run folder's file: one of the names, a path with one as a part
    ("checkpoints/step-3", "x/log.txt"), a name ending in one ("failed-1.log.txt"), a checkpoint's
    step-N, or the half-written mark (`tmp_too`). Prose (a sentence with spaces) is not a path."""
    if value in RUN_FILE_NAMES or (tmp_too and value == runs.TMP_SUFFIX):
        return True
    if not value or any(c.isspace() for c in value):
        return False
    parts = value.replace("\\", "/").split("/")
    return any(
        p in RUN_FILE_NAMES or re.fullmatch(r"(step|checkpoint)-\d*", p) or p.endswith(tuple(RUN_FILE_NAMES))
        for p in parts
        if p
    )


def test_run_folder_names_are_spelled_in_engine_runs_only():
    found = []
    for package in ("engine", "studio", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if (ROOT / "engine" / "runs") in path.parents:
                continue
            for line, value in _string_constants(path):
                # The bench's peers write their own records (.tmp, renamed); no run folder's.
                if _names_a_run_file(value, tmp_too=package != "bench"):
                    found.append(f"{path.relative_to(ROOT)}:{line} {value!r}")
    # A child process's own temporary config is not a run folder's file.
    found = [f for f in found if not f.startswith("studio/process_worker.py") or "config.yaml" not in f]
    assert not found, "run-folder names spelled outside engine/runs/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "value,spelled",
    [
        ("log.txt", True),
        ("checkpoints/step-3", True),
        ("step-", True),
        ("failed-1.log.txt", True),
        (".tmp", True),
        ("adapter_model.safetensors", True),
        ("log.txt was not written", False),  # a sentence naming a file
        ("step", False),
        ("metrics", False),
    ],
)
def test_the_name_scan_finds_a_spelled_name(value, spelled):
    assert _names_a_run_file(value, tmp_too=True) is spelled


def _run(tmp_path: Path, last: dict | None, checkpoint: bool = True) -> RunFolder:
    run = RunFolder(tmp_path / "r").create(fresh=True)
    run.config.write_text("model:\n  name_or_path: demo\n")
    if checkpoint:
        run.checkpoint(2).mkdir()
    lines = [{"event": "RunStarted", "time": time.time()}, {"event": "StepMetrics", "step": 1, "loss": 2.0}]
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in lines + ([last] if last else [])))
    return run


@pytest.mark.parametrize(
    "last,checkpoint",
    [
        ({"event": "Finished", "stopped": False}, True),
        ({"event": "Finished", "stopped": True}, True),
        ({"event": "Failed"}, True),
        ({"event": "Failed"}, False),
        (None, True),
    ],
)
def test_one_summary_and_one_resume_decision(tmp_path, last, checkpoint):
    run = _run(tmp_path, last, checkpoint)
    info, summary = run.info(), run.summary()
    assert isinstance(summary, RunSummary) and isinstance(summary, RunInfo)  # the summary is a RunInfo
    assert info.status == summary.status
    assert info.sources() == summary.sources()
    assert run.why_not_resumable() == info.why_not_resumable() == summary.why_not_resumable()
    assert info.resumable == summary.resumable == (not run.why_not_resumable())
    # The caller that trains the run says so, and every form of the decision refuses it then.
    ours = f"{run.path.name} is running."
    assert run.why_not_resumable(ours=True) == info.why_not_resumable(ours=True) == ours


def test_the_shown_status_rule(tmp_path):
    run = _run(tmp_path, None)
    assert runs.shown_status("incomplete") == "incomplete"
    assert runs.shown_status("incomplete", busy=True) == "running"
    assert runs.shown_status("finished", busy=True) == "finished"  # an outcome in the files wins
    assert runs.shown_status("stopped", ours=True) == "running"  # the window's resumed run
    assert run.written_within(runs.RUNNING_WINDOW_S)
    old = time.time() - 2 * runs.RUNNING_WINDOW_S
    for f in (run.metrics, run.log):
        if f.exists():
            os.utime(f, (old, old))
    assert not run.written_within(runs.RUNNING_WINDOW_S)


def test_every_kind_states_its_limits_and_options():
    for kind in EXPORTERS.values():
        assert kind.verify is not None and kind.thresholds, kind.name
        choices = kind.options[0].choices if kind.options else ("",)
        for choice in choices:  # every choice of its first option has limits
            key = {kind.options[0].name: choice} if kind.options else {}
            assert isinstance(kind.limits(**key), Thresholds)
        assert set(kind.thresholds) == set(choices), kind.name
        if kind.builds_on:  # the kind it reuses is written (and checked) before it
            assert list(EXPORTERS).index(kind.builds_on) < list(EXPORTERS).index(kind.name)
    assert any(k.pushable for k in EXPORTERS.values())


def _fake_adapter_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    adapter = run / runs.ADAPTER
    adapter.mkdir(parents=True)
    (run / runs.CONFIG).write_text("model:\n  name_or_path: demo\n")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    header = json.dumps({"q_proj.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    return run


def _copy_kind(calls: list) -> ExportKind:
    """A kind the flow has never heard of: it takes an option and builds on the adapter export."""

    def write(source, out, progress=None, **options):
        calls.append(("write", dict(options)))
        options["extras"]["shouted"] = options["shout"]
        (out / "note.json").write_text(json.dumps({"shout": options["shout"], "from": str(options.get("built_on"))}))

    def estimate(source, **options):
        calls.append(("estimate", dict(options)))
        return 1

    def check(folder):
        check_json(folder / "note.json")

    return ExportKind(
        name="note",
        title="note",
        label="A note",
        help="folder for a note",
        stage="Writing a note…",
        write=write,
        check=check,
        estimate=estimate,
        options=(ExportOption("shout", ("no", "yes"), "shout or not"),),
        thresholds={"no": Thresholds(1, 0, 0, "exact"), "yes": Thresholds(1, 0, 0, "exact")},
        builds_on="adapter",
        notes=lambda extras: [f"a note was written (shout: {extras['shouted']})"],
    )


def test_a_new_kind_goes_through_the_flow_with_its_options_and_what_it_builds_on(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(EXPORTERS, "note", _copy_kind(calls))
    run = _fake_adapter_run(tmp_path)
    out = tmp_path / "out"
    requests = {"adapter": out / "adapter", "note": out / "note"}
    result = export_and_check(run, requests, verify=False)
    assert sorted(result.written) == sorted(str(p) for p in requests.values())
    written = dict(calls)
    assert written["estimate"]["shout"] == "no"  # the option's default
    assert written["estimate"]["built_on"] == out / "adapter"
    assert json.loads((out / "note" / "note.json").read_text()) == {"shout": "no", "from": str(out / "adapter")}
    calls.clear()
    export_and_check(run, {"note": tmp_path / "alone"}, verify=False, options={"note": {"shout": "yes"}})
    assert dict(calls)["write"]["shout"] == "yes" and "built_on" not in dict(calls)["write"]
    with pytest.raises(ExportError, match="no self-check limits"):
        EXPORTERS["note"].limits(shout="maybe")


def test_the_cli_lists_a_new_kind_and_its_options(tmp_path, monkeypatch, capsys):
    from engine import cli

    monkeypatch.setitem(EXPORTERS, "note", _copy_kind([]))
    run = _fake_adapter_run(tmp_path)
    out = tmp_path / "n"
    parser = cli.build_parser()
    args = parser.parse_args(["export", str(run), "--note", str(out), "--shout", "yes"])
    assert args.note == str(out) and args.shout == "yes"
    # The flow self-checks by default; this note kind has no verify, so it is published as written.
    assert cli.cmd_export(args) == 0
    assert json.loads((out / "note.json").read_text())["shout"] == "yes"
    assert "a note was written (shout: yes)" in capsys.readouterr().out


def test_cuda_streams_are_made_in_one_place():
    """A stream made per run leaves its cuBLAS workspace allocated when the run ends (64 MiB a run
    on an H100): the engine's side streams come from engine.fastpath.streams, which makes each
    (device, role) once per process."""
    home = ROOT / "engine" / "fastpath" / "streams.py"
    makers = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.cuda.Stream", "cuda.Stream", "Stream"):
                makers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert makers and all(m.startswith(str(home.relative_to(ROOT)) + ":") for m in makers), makers
