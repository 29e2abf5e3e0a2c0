"""GRPO's decode loop on a GPU (engine.train.decoding): the step captured as a CUDA graph gives
the eager loop's tokens exactly (greedy and sampled, same seed), both equal transformers'
`generate` greedily in fp32, and the graph is really on. Tiny patched Qwen3 with LoRA, the
Triton kernels and the fused LoRA paths of a real run; Mistral's sliding windows (made inside the
captured step), Gemma-2's softcaps, Gemma-3's rotary tables per layer type, and GPT-OSS's sinks
and windows (eager: its expert routing is not captured).
Run: pytest -m gpu tests/gpu/test_grpo_decoding_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from engine.config import FastPathConfig
from engine.models.patches import apply_fast_paths
from engine.train import decoding
from engine.train.objectives.grpo import generate_completions
from tests.tiny_models import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50]]


SIZE = dict(hidden_size=256, head_dim=64, vocab_size=512)


def patched(dtype, model_type="qwen3", **kw):
    model = tiny_model(model_type, lora={}, lora_b_std=0.02, norm_std=0.1, dtype=dtype, **dict(SIZE, **kw))
    with torch.no_grad():  # sinks at a trained model's scale (as in the CPU test)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
    model = model.cuda()
    apply_fast_paths(model, FastPathConfig(), "cuda")
    return model.eval()


def run(model, group, new, greedy, graphs, seed=7, temperature=0.8, top_p=0.9):
    report = {}
    with torch.no_grad():
        torch.manual_seed(seed)
        rows = decoding.decode(
            model, PROMPTS, group, new, temperature, top_p, {10**6}, 0, "cuda", greedy, graphs=graphs, report=report
        )
    return rows, report["graph"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_captured_step_gives_the_eager_loops_tokens(dtype):
    model = patched(dtype)
    assert decoding.decode_refusal(model, 64) is None
    assert decoding.graph_refusal(model, "cuda") is None
    for greedy, group in ((False, 8), (True, 1)):
        graphed, state = run(model, group, 40, greedy, graphs=None)
        eager, eager_state = run(model, group, 40, greedy, graphs=False)
        assert state == "on" and eager_state.startswith("off")
        assert graphed == eager


def test_greedy_decoding_equals_generate_in_fp32():
    model = patched(torch.float32)
    rows, state = run(model, 1, 32, True, graphs=None)
    assert state == "on"
    with torch.no_grad():
        ref = generate_completions(model, PROMPTS, 1, 32, 1.0, 1.0, {10**6}, 0, "cuda", greedy=True)
    assert rows == ref


@pytest.mark.parametrize(
    "model_type, kw, graph",
    [
        ("mistral", dict(sliding_window=8), "on"),
        ("gemma3_text", dict(), "on"),  # its tiny config: 8-token window, a rotary table per layer type
        ("gemma2", dict(attn="eager"), "on"),  # softcaps and an 8-token window
        ("gpt_oss", dict(attn="eager", sliding_window=8), "off"),
        # Phi-3's stock modules (not patched): its fused qkv_proj, the config's window, a partial rotation
        ("phi3", dict(sliding_window=8, partial_rotary_factor=0.75, pad_token_id=0), "on"),
    ],
    ids=["mistral", "gemma3_text", "gemma2", "gpt_oss", "phi3"],
)
def test_windows_and_sinks_equal_generate_greedily_in_fp32(model_type, kw, graph):
    model = patched(torch.float32, model_type, **kw)
    assert decoding.decode_refusal(model, 64) is None
    assert 8 in decoding._Layers(model).windows
    rows, state = run(model, 1, 32, True, graphs=None)
    assert state.split(":")[0] == graph, state
    with torch.no_grad():
        ref = generate_completions(model, PROMPTS, 1, 32, 1.0, 1.0, {10**6}, 0, "cuda", greedy=True)
    assert rows == ref
