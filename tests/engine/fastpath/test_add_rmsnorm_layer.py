"""The residual add fused with the norm after it, inside the patched decoder layers
(engine.models.patches, fast_paths.add_rmsnorm): one training step on tiny models on the CPU gives the
same loss and LoRA gradients as the unfused path, with gradient checkpointing and with offload
(whose recompute runs the fused layer again), through the Triton kernel in the interpreter and
through its torch reference; the counters say it ran once per layer per forward, the switch turns
it off, and generation with a KV cache keeps the stock layer."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import FastPathConfig, LoraConfig
from engine.counters import reset_counters, split_counts
from engine.data.collate import PackedBatch
from engine.fastpath import patching
from engine.models.lora import attach_lora
from engine.models.patches import apply_fast_paths
from engine.train.step import forward_loss, prepare_model

CPU = torch.device("cpu")
LAYERS = 3
LENGTHS = (7, 12, 5, 9)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def tiny(model_type: str):
    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
    )
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    attn = "eager" if model_type == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma-2
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # norm weights away from their init, so a wrong offset or weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0 if "gemma" not in model_type else 0.0, 0.2)
    return attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))


def batch() -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    return PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS])


def step(model_type: str, fused: bool, mode: str, impl: str):
    """One forward + backward; (loss, LoRA grads, counted calls, fallbacks, report)."""
    model = tiny(model_type)
    # The full recompute under offload (its lean one skips the fused add: test_lean_recompute.py).
    fast = FastPathConfig(add_rmsnorm=fused, lean_recompute=False)
    prepared = prepare_model(
        model, fast, CPU, gradient_checkpointing=mode != "plain", offload="single" if mode == "offload" else "off"
    )
    report = prepared.report
    if impl == "triton":  # every kernel through Triton (the interpreter here), the fused one included
        report = {**report, **apply_fast_paths(model, fast, CPU, kernel_impl="triton")}
    model.train()
    b = batch()
    reset_counters()
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    loss.backward()
    calls, fallbacks = split_counts(reset_counters())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    if mode == "offload":
        assert prepared.offloader is not None and prepared.offloader.stats.layers == LAYERS
    return loss.detach(), grads, calls, fallbacks, report


def assert_same_step(a, b, tol):
    assert abs(a[0].item() - b[0].item()) <= tol * abs(b[0].item())
    assert a[1].keys() == b[1].keys()
    for n in b[1]:
        err = ((a[1][n] - b[1][n]).norm() / b[1][n].norm().clamp_min(1e-30)).item()
        assert err <= tol, (n, err)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize(
    "model_type,mode",
    [("qwen3", "plain"), ("qwen3", "checkpointing"), ("qwen3", "offload"), ("gemma2", "checkpointing")],
)
def test_fused_triton_step_matches_the_unfused_one(monkeypatch, model_type, mode):
    # The layer's input norm also returns its input (rms_norm_passing, on by default), so its backward
    # kernel adds the residual's gradient: every layer whose input takes a gradient (not the first: the
    # frozen embeddings' output takes none), the same step as unfused. TUNESMITH_PASSING_NORM=0 keeps
    # the stock pair (the checkpointed case).
    from engine.kernels import add_rmsnorm

    passing = []
    real = add_rmsnorm.RMSNormPassingFunction.backward

    def counted(ctx, dy, dx_passed):
        passing.append(dx_passed is not None)
        return real(ctx, dy, dx_passed)

    monkeypatch.setattr(add_rmsnorm.RMSNormPassingFunction, "backward", staticmethod(counted))
    off = mode == "checkpointing" and model_type == "qwen3"
    if off:
        monkeypatch.setenv("TUNESMITH_PASSING_NORM", "0")
    else:
        monkeypatch.delenv("TUNESMITH_PASSING_NORM", raising=False)
    fused = step(model_type, True, mode, "triton")
    assert passing == ([] if off else [True] * (LAYERS - 1))
    plain = step(model_type, False, mode, "triton")
    assert fused[4]["add_rmsnorm"] == "on" and plain[4]["add_rmsnorm"] == "off: fast_paths.add_rmsnorm is false"
    assert_same_step(fused, plain, tol=1e-5)
    forwards = 1 if mode == "plain" else 2  # checkpointing and offload run each layer's forward again
    assert fused[3] == {} and plain[3] == {}
    assert fused[2]["add_rmsnorm:triton"] == forwards * LAYERS
    assert "add_rmsnorm:triton" not in plain[2]
    # The fused norm is still a norm computed: every layer's two, and the final one, either way.
    norms_per_layer = 4 if model_type == "gemma2" else 2
    qk_norms = 2 if model_type == "qwen3" else 0
    assert (
        fused[2]["rmsnorm:triton"] == plain[2]["rmsnorm:triton"] == forwards * LAYERS * (norms_per_layer + qk_norms) + 1
    )


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gemma2"])
def test_reference_path_on_cpu_is_the_stock_arithmetic(model_type):
    fused = step(model_type, "auto", "checkpointing", "auto")
    plain = step(model_type, False, "checkpointing", "auto")
    assert fused[4]["add_rmsnorm"] == "on"
    # The reference is the stock add and engine.kernels.rmsnorm's reference, op for op.
    assert_same_step(fused, plain, tol=0.0)
    assert fused[2]["add_rmsnorm:torch"] == 2 * LAYERS and fused[3] == {}


def test_generation_with_a_cache_keeps_the_stock_layer():
    model = tiny("qwen3")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (1, 10), generator=g)
    model.eval()
    with torch.no_grad():
        cache = model(input_ids=ids[:, :9], use_cache=True)
        ref = model(input_ids=ids[:, 9:10], past_key_values=cache.past_key_values, use_cache=True).logits
        full_ref = model(input_ids=ids, use_cache=False).logits
        report = apply_fast_paths(model, FastPathConfig(), CPU)
        assert report["add_rmsnorm"] == "on"
        layers = [m for m in model.modules() if type(m).__name__ == "Qwen3DecoderLayer"]
        assert len(layers) == LAYERS and all(patching.installed(m) is not None for m in layers)
        reset_counters()
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, full_ref, rtol=1e-5, atol=1e-5)
        cache = model(input_ids=ids[:, :9], use_cache=True)
        nxt = model(input_ids=ids[:, 9:10], past_key_values=cache.past_key_values, use_cache=True).logits
        calls, fallbacks = split_counts(reset_counters())
    torch.testing.assert_close(nxt, ref, rtol=1e-5, atol=1e-5)
    assert calls["add_rmsnorm:torch"] == LAYERS  # the cache-free forward
    assert fallbacks == {"add_rmsnorm: KV cache": 2 * LAYERS, "attention: KV cache": 2 * LAYERS}


def test_kernels_off_turns_it_off_too():
    model = tiny("llama")
    report = apply_fast_paths(model, FastPathConfig(kernels=False), CPU)
    assert report["add_rmsnorm"] == "off: fast_paths.kernels is false"
    assert not any(patching.installed(m) for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer")
