"""A Gemma-2 run whose folders hold no tokenizer.model: the GGUF export refuses in one sentence
before anything is written (llama.cpp converts a Gemma-2 vocabulary from that SentencePiece file
only; without this the merged model was written first, then the converter stopped with "File not
found: tokenizer.model").

Why not a Gemma-2 GGUF in the conformance export instead: the suite's Gemma-2 stands in gemma-4's
vocabulary (llama.cpp's sdist holds no Gemma-2 one), which is BPE with merges; a tokenizer.model
rebuilt from its pieces and scores (sentencepiece_model.write_tokenizer_model, as for the
SentencePiece families) is not that tokenizer (test_gguf_families.NOT_CONVERTED says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.export import EXPORTERS, ExportError, ExportSource, export_and_check
from engine.export import gguf as gguf_kind
from tests.engine.export_conformance.test_gguf_families import make_run


@pytest.fixture(scope="module")
def gemma2_run(tmp_path_factory):
    run = make_run("gemma-2", tmp_path_factory.mktemp("gemma2"))
    base = ExportSource.resolve(run).config().model.name_or_path
    return run, base


def test_the_refusal_is_one_sentence_before_anything_is_written(gemma2_run, tmp_path):
    run, base = gemma2_run
    out = tmp_path / "exports"
    with pytest.raises(ExportError) as err:
        # The merged export comes first in registry order: it is not written either.
        export_and_check(run, {"merged": out / "merged", "gguf": out / "gguf"}, verify=False)
    message = str(err.value)
    assert message == (
        "the GGUF export of this Gemma-2 model needs its tokenizer.model (llama.cpp's converter reads a "
        "Gemma-2 vocabulary from that SentencePiece file only), and neither the run's adapter folder nor the "
        f"base model folder holds one: copy tokenizer.model from the model's Hugging Face repository into {base}"
    )
    assert message.count(". ") == 0 and "\n" not in message
    assert not out.exists()
    with pytest.raises(ExportError, match=r"^the GGUF export of this Gemma-2 model needs its tokenizer\.model"):
        export_and_check(run, {"gguf": out / "model.gguf"}, verify=False)
    assert not out.exists()


def test_a_tokenizer_model_beside_the_base_or_the_adapter_lifts_it(gemma2_run):
    run, base = gemma2_run
    source = ExportSource.resolve(run)
    assert gguf_kind.refuses(source) is not None
    for folder in (Path(base), source.adapter):
        (folder / "tokenizer.model").write_bytes(b"\n")  # only its presence is asked here
        try:
            assert gguf_kind.refuses(source) is None
        finally:
            (folder / "tokenizer.model").unlink()
    assert gguf_kind.refuses(source) is not None


def test_other_families_are_not_refused(tmp_path):
    run = make_run("qwen3", tmp_path)
    assert gguf_kind.refuses(ExportSource.resolve(run)) is None
    assert EXPORTERS["gguf"].refuses is gguf_kind.refuses
