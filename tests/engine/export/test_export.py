"""The export registry and its one flow (run_exports), on a fake run folder: no model loads
(`verify=False`: a fake adapter cannot be self-checked), so these run in a second. The real
exports of a trained run, with their self-checks, are in test_export_selfcheck.py (and
test_session.py, test_cli.py); the fake adapter's self-check failing is the last test here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import runs
from engine.export import EXPORTERS, ExportError, ExportKind, destinations, export_adapter, run_exports


def _safetensors(path: Path, names: list[str]) -> None:
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4 * len(names))


def _fake_run(root: Path, step: int | None = None) -> Path:
    """A run folder with config.yaml and an adapter (final, or only in checkpoint step-N)."""
    run = root / "run"
    run.mkdir(parents=True)
    (run / runs.CONFIG).write_text("model:\n  name_or_path: demo\n")
    adapter = run / runs.ADAPTER if step is None else run / runs.CHECKPOINTS / f"step-{step}" / runs.ADAPTER
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    _safetensors(adapter / "adapter_model.safetensors", ["base_model.model.q_proj.lora_A.weight"])
    (adapter / "tokenizer.json").write_text("{}")
    return run


def test_registry_shape():
    assert list(EXPORTERS) == ["adapter", "merged", "gguf"]
    for name, kind in EXPORTERS.items():
        assert isinstance(kind, ExportKind) and kind.name == name
        assert kind.title and kind.label and kind.help and kind.stage
        assert callable(kind.write) and callable(kind.check)
    assert EXPORTERS["adapter"].requires == ()
    assert {"torch", "transformers", "peft"} <= set(EXPORTERS["merged"].requires)
    assert {"llama_cpp", "gguf"} <= set(EXPORTERS["gguf"].requires)
    assert all(k.verify is not None for k in EXPORTERS.values())  # every kind is self-checked


def test_destinations_one_kind_in_the_folder_several_in_subfolders(tmp_path):
    assert destinations(tmp_path, ["adapter"]) == {"adapter": tmp_path}
    assert destinations(tmp_path, ["adapter", "merged"]) == {
        "adapter": tmp_path / "adapter",
        "merged": tmp_path / "merged",
    }


def test_adapter_export_copies_checks_and_reports(tmp_path):
    run = _fake_run(tmp_path)
    lines = []
    written = run_exports(run, {"adapter": tmp_path / "out"}, progress=lines.append, verify=False)
    assert written == {str(tmp_path / "out"): ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]}
    assert "Writing the LoRA adapter…" in lines and any(line.startswith("adapter written to") for line in lines)
    assert not (tmp_path / ".out.partial").exists()
    report = json.loads(runs.RunFolder(run).export_report("adapter").read_text())
    assert report["kind"] == "adapter" and report["files"] == written[str(tmp_path / "out")]


def test_a_checkpoint_is_a_source_too(tmp_path):
    run = _fake_run(tmp_path, step=3)
    files = export_adapter(run, tmp_path / "out", verify=False)  # a run with checkpoints only: the latest one
    assert "adapter_model.safetensors" in files
    files = export_adapter(run / "checkpoints" / "step-3", tmp_path / "out2", verify=False)
    assert "adapter_model.safetensors" in files


def test_refusals_come_before_anything_is_written(tmp_path):
    run = _fake_run(tmp_path)
    with pytest.raises(ExportError, match="does not exist"):
        run_exports(tmp_path / "missing", {"adapter": tmp_path / "a"})
    with pytest.raises(ExportError, match="holds no adapter"):
        run_exports(tmp_path, {"adapter": tmp_path / "a"})
    with pytest.raises(ExportError, match="unknown export kind 'onnx'"):
        run_exports(run, {"onnx": tmp_path / "a"})
    with pytest.raises(ExportError, match="need different folders"):
        run_exports(run, {"adapter": tmp_path / "same", "merged": tmp_path / "same"})
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    # The merged export's folder is refused before the adapter is written.
    with pytest.raises(ExportError, match="already exists and is not empty"):
        run_exports(run, {"adapter": tmp_path / "a", "merged": busy})
    assert not (tmp_path / "a").exists()
    files = export_adapter(run, busy, overwrite=True, verify=False)
    assert not (busy / "x").exists() and "adapter_config.json" in files


def test_a_missing_requirement_is_named(tmp_path, monkeypatch):
    run = _fake_run(tmp_path)
    kind = EXPORTERS["merged"]
    monkeypatch.setitem(EXPORTERS, "merged", ExportKind(**{**kind.__dict__, "requires": ("no_such_module_xyz",)}))
    with pytest.raises(ExportError, match="merged model export needs no_such_module_xyz installed"):
        run_exports(run, {"merged": tmp_path / "m"})


def test_a_failed_check_leaves_nothing_behind(tmp_path):
    run = _fake_run(tmp_path)
    _safetensors(run / "adapter" / "adapter_model.safetensors", ["model.q_proj.weight"])  # no LoRA tensor
    with pytest.raises(ExportError, match="holds no LoRA weights"):
        run_exports(run, {"adapter": tmp_path / "out"}, verify=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ExportError, match="not a safetensors file|not a readable safetensors file"):
        run_exports(run, {"adapter": tmp_path / "out"}, verify=False)


def test_merged_export_without_a_run_config_says_the_base_is_unknown(tmp_path):
    run = _fake_run(tmp_path)
    (run / "config.yaml").unlink()
    with pytest.raises(ExportError, match="cannot find the run's config.yaml"):
        run_exports(run / "adapter", {"merged": tmp_path / "m"})
    assert not (tmp_path / "m").exists()


def test_cli_options_come_from_the_registry(tmp_path):
    from engine.cli import build_parser

    export = build_parser()._subparsers._group_actions[0].choices["export"]
    options = {a.dest for a in export._actions}
    assert set(EXPORTERS) <= options and "quant" in options
    run = _fake_run(tmp_path)
    none = subprocess.run(
        [sys.executable, "-m", "engine", "export", str(run)], capture_output=True, text=True, timeout=120
    )
    assert none.returncode == 2
    assert "say what to export: --adapter DIR and/or --merged DIR and/or --gguf OUT.gguf" in none.stderr


def test_a_fake_adapter_fails_its_self_check_and_nothing_is_left(tmp_path):
    """The fake adapter's one-element tensor cannot be loaded by PEFT onto the demo base: the
    self-check says so, nothing is published, and export-report.json records the failure."""
    run = _fake_run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "engine", "export", str(run), "--adapter", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert "failed its self-check" in out.stderr and "self-check could not run" in out.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()
    report = json.loads((run / "export-report.json").read_text())
    assert report["exports"]["adapter"]["status"] == "failed"


def test_a_full_disk_is_one_sentence_before_anything_is_written(tmp_path, monkeypatch):
    import engine.export as export

    run = _fake_run(tmp_path)
    monkeypatch.setattr(export, "disk_free", lambda path: 10)  # the disk, not the export, is the stand-in
    with pytest.raises(ExportError) as err:
        run_exports(run, {"adapter": tmp_path / "out"}, verify=False)
    msg = str(err.value)
    assert msg.startswith("not enough disk space on the disk mounted at /") and msg.count(". ") == 0
    assert "needs about" in msg and msg.endswith("and 10 bytes is free")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_a_disk_that_fills_up_while_writing_is_one_sentence_too(tmp_path, monkeypatch):
    """The estimate can fall short (another program writes too): ENOSPC in the middle of a write
    becomes one sentence and the partial folder goes."""
    import errno

    run = _fake_run(tmp_path)
    kind = EXPORTERS["adapter"]

    def write(source, out, progress=None, **_options):
        (out / "half").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "adapter_model.safetensors"))

    monkeypatch.setitem(EXPORTERS, "adapter", ExportKind(**{**kind.__dict__, "write": write}))
    with pytest.raises(ExportError, match=r"^the disk mounted at /\S* filled up while the adapter was being written"):
        run_exports(run, {"adapter": tmp_path / "out"}, verify=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
