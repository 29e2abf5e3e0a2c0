"""A GGUF that llama.cpp aborts on is a failed self-check with llama.cpp's reason, never a dead
process: a failed GGML_ASSERT aborts the process it runs in, and the studio exports in its
window's process. Found on a Llama-4 text model (fourteenth session's family sweep): llama.cpp
0.3.36 converts and loads it, then aborts in its first decode ("tensor buffer not set"), which
killed `tunesmith export` (exit 134) after it had printed nothing but its progress.

The GGUFs here are real: tiny random-weight folders of two families, converted by llama.cpp's own
converter (the pinned sdist's, fetched when the test data is built)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.export import gguf as gguf_kind
from engine.export.selfcheck import Probe
from tests.learning_parity import random_model_folder

MISSING = gguf_kind.missing()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"tunesmith[gguf] is not installed ({', '.join(MISSING)} missing)"
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
PROBE = Probe(messages=[], ids=[1, 5, 6, 7, 8, 9, 10], positions=[3, 4], prompt_ids=[1, 5, 6], prompt="")


def _gguf(tmp_path: Path, family: str) -> Path:
    folder = random_model_folder(tmp_path / family, family, **SHAPE)
    out = tmp_path / f"{family}.gguf"
    gguf_kind._run_converter(folder, out, "bf16", None)
    return out


def test_a_gguf_llama_cpp_aborts_on_is_named_and_this_process_lives(tmp_path):
    why = gguf_kind._crashes_in_child(_gguf(tmp_path, "llama4_text"), 512, 1, [PROBE])
    assert why is not None and "GGML_ASSERT" in why and "tensor buffer not set" in why, why


def test_a_gguf_llama_cpp_runs_passes_the_child_check(tmp_path):
    assert gguf_kind._crashes_in_child(_gguf(tmp_path, "llama"), 512, 1, [PROBE]) is None
