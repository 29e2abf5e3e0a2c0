"""Two GGUF exports into one folder: each GGUF gets its own Modelfile. The first keeps `Modelfile`
(what `ollama create` reads by default); a later GGUF whose folder's `Modelfile` is another GGUF's
gets `<name>.Modelfile` beside it, and the `ollama create` command names it. Before, the second
export stopped with "Modelfile already exists" (or, overwriting, took the first GGUF's Modelfile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.export import EXPORTERS, ExportError, _check_destination, modelfile
from engine.export import gguf as gguf_kind

GGUF_MISSING = gguf_kind.missing()
needs_gguf = pytest.mark.skipif(bool(GGUF_MISSING), reason=f"tunesmith[gguf] is not installed: {GGUF_MISSING}")


def _tokenizer():
    from transformers import AutoTokenizer

    from engine.resources import DEMO_MODEL_DIR

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def _modelfile_for(folder: Path, gguf: str, name: str = modelfile.MODELFILE) -> Path:
    modelfile.write_modelfile(folder, gguf, _tokenizer(), {"eos_token_id": 2}, name=name)
    return folder / name


def test_the_modelfile_name_depends_on_whose_modelfile_the_folder_holds(tmp_path):
    assert modelfile.modelfile_name(tmp_path, "a.gguf") == "Modelfile"  # an empty folder
    _modelfile_for(tmp_path, "a.gguf")
    assert modelfile.modelfile_name(tmp_path, "a.gguf") == "Modelfile"  # its own: written again
    assert modelfile.modelfile_name(tmp_path, "b-q4_k_m.gguf") == "b-q4_k_m.Modelfile"
    (tmp_path / "Modelfile").write_text("# a person's own Modelfile, no FROM\n")
    assert modelfile.modelfile_name(tmp_path, "a.gguf") == "a.Modelfile"


def test_each_modelfile_is_found_by_its_gguf(tmp_path):
    _modelfile_for(tmp_path, "a.gguf")
    _modelfile_for(tmp_path, "b.gguf", "b.Modelfile")
    assert modelfile.modelfile_of(tmp_path, "a.gguf") == tmp_path / "Modelfile"
    assert modelfile.modelfile_of(tmp_path, "b.gguf") == tmp_path / "b.Modelfile"
    assert modelfile.modelfile_of(tmp_path, "c.gguf") is None
    text = (tmp_path / "b.Modelfile").read_text()
    assert "`ollama create NAME -f b.Modelfile`" in text and "\nFROM ./b.gguf\n" in text
    assert modelfile.read_modelfile(tmp_path / "b.Modelfile")["from"] == "./b.gguf"


def test_a_second_gguf_into_the_folder_is_not_refused(tmp_path):
    kind = EXPORTERS["gguf"]
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    _modelfile_for(tmp_path, "a.gguf")
    _check_destination(tmp_path / "b.gguf", False, kind)  # raised "Modelfile already exists"
    assert kind.companions(tmp_path / "b.gguf") == ("b.Modelfile",)
    assert kind.companions(tmp_path / "a.gguf") == ("Modelfile",)
    _modelfile_for(tmp_path, "b.gguf", "b.Modelfile")
    with pytest.raises(ExportError, match=r"b\.Modelfile already exists; choose another name or overwrite"):
        _check_destination(tmp_path / "b.gguf", False, kind)


def test_the_check_wants_the_modelfile_of_its_gguf(tmp_path):
    (tmp_path / "b.gguf").write_bytes(b"GGUF....")
    _modelfile_for(tmp_path, "a.gguf")  # another GGUF's
    with pytest.raises(ExportError, match=r"no Modelfile whose FROM is \./b\.gguf"):
        gguf_kind.check(tmp_path)
    _modelfile_for(tmp_path, "b.gguf", "b.Modelfile")
    gguf_kind.check(tmp_path)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """The demo preset trained for two steps: a run folder with an adapter to export."""
    from engine.api import DEMO_PRESET, Finished, RunConfig, TrainingSession

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.training.max_steps = 2
    cfg.training.save_every = 0
    cfg.output.dir = str(tmp_path_factory.mktemp("runs"))
    cfg.output.run_name = "two"
    result = TrainingSession(cfg, lambda e: None).run()
    assert isinstance(result, Finished), getattr(result, "message", result)
    return Path(cfg.output.dir) / "two"


@needs_gguf
@pytest.mark.slow
def test_two_gguf_exports_into_one_folder_each_get_a_modelfile(run_folder, tmp_path):
    from engine.export import export_and_check

    out = tmp_path / "models"
    first = export_and_check(
        run_folder, {"gguf": out / "two-f16.gguf"}, options={"gguf": {"quant": "f16"}}, verify=False
    )
    second = export_and_check(
        run_folder, {"gguf": out / "two-q8_0.gguf"}, options={"gguf": {"quant": "q8_0"}}, verify=False
    )
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "two-f16.gguf", "two-q8_0.Modelfile", "two-q8_0.gguf"]
    assert modelfile.read_modelfile(out / "Modelfile")["from"] == "./two-f16.gguf"
    assert modelfile.read_modelfile(out / "two-q8_0.Modelfile")["from"] == "./two-q8_0.gguf"
    assert first.extras["gguf"]["ollama_command"] == f'ollama create two-f16 -f "{out / "Modelfile"}"'
    assert second.extras["gguf"]["ollama_command"] == f'ollama create two-q8_0 -f "{out / "two-q8_0.Modelfile"}"'
    # Each Modelfile holds the same template and stops (one tokenizer); only FROM differs.
    a, b = (modelfile.read_modelfile(out / n) for n in ("Modelfile", "two-q8_0.Modelfile"))
    assert a["template"] == b["template"] is not None and a["stops"] == b["stops"]

    # The second written again, overwriting: its own Modelfile, the first's left as it was.
    before = (out / "Modelfile").read_bytes()
    export_and_check(
        run_folder, {"gguf": out / "two-q8_0.gguf"}, overwrite=True, options={"gguf": {"quant": "q8_0"}}, verify=False
    )
    assert (out / "Modelfile").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "two-f16.gguf", "two-q8_0.Modelfile", "two-q8_0.gguf"]
