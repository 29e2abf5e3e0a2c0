"""GPU parity of the patched models (Triton kernels + fused LoRA) at realistic layer shapes.

Qwen3-0.6B-like layers (hidden 1024, intermediate 3072, 16 heads, 8 KV heads, head_dim 128) with
two decoder layers and a small vocabulary, one packed row of ~4k tokens, PEFT defaults (bf16 base,
fp32 adapters, r=16). Patched vs stock HF + PEFT: fp32 within 1e-4, bf16 no worse than stock bf16
against an fp32 reference (and within the 1e-2 of WORKLOADS.md). Run: pytest -m gpu tests/gpu
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import FastPathConfig
from engine.models.patches import FAST_PATHS, REGISTRY, apply_fast_paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]
ALL_ON = {k: "on" for k in FAST_PATHS}
ARCH_EXTRA = {
    "mistral": dict(sliding_window=512),
    "qwen2": dict(use_sliding_window=True, sliding_window=512, max_window_layers=1),
    "gemma2": dict(
        sliding_window=512, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=128
    ),
}


def build(model_type, dtype, attn="sdpa", layers=2, seed=0):
    kw = dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=8192,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    if model_type == "qwen2":
        kw["attention_bias"] = True
    kw.update(ARCH_EXTRA.get(model_type, {}))
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if REGISTRY[model_type].norm_offset == 0 else 0.0, 0.1)
    model = model.to(device=CUDA, dtype=dtype)
    # PEFT's default keeps adapters in fp32 on a bf16 base, as the engine runs them.
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return peft_model


def packed_row(total=4096, vocab=8192, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(torch.empty(1).log_normal_(5.3, 0.7, generator=g).clamp(16, 2048))
        lengths.append(min(n, total - sum(lengths)))
    ids = torch.randint(0, vocab, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids.to(CUDA), pos.to(CUDA), lengths


def step(model, ids, pos, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach().float(), grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_parity(got, stock, ref, slack, limit):
    """got and stock against ref: got may be at most 2x stock's error plus slack, and < limit."""
    assert rel(got[0], ref[0]) <= 2 * rel(stock[0], ref[0]) + slack
    for n in ref[1]:
        e_got, e_stock = rel(got[1][n], ref[1][n]), rel(stock[1][n], ref[1][n])
        assert e_got <= 2 * e_stock + slack, (n, e_got, e_stock)
        assert e_got <= limit, (n, e_got)


@pytest.mark.parametrize("model_type", ARCHS)
def test_fp32_parity_cuda(model_type):
    model = build(model_type, torch.float32, attn="eager" if model_type == "gemma2" else "sdpa")
    ids, pos, _ = packed_row(total=2048)
    ref = step(model, ids, pos)
    assert apply_fast_paths(model, FastPathConfig(), CUDA) == ALL_ON
    got = step(model, ids, pos)
    assert rel(got[0], ref[0]) <= 1e-4
    for n in ref[1]:
        assert rel(got[1][n], ref[1][n]) <= 1e-4, n


@pytest.mark.parametrize("model_type", ARCHS)
def test_bf16_parity_cuda(model_type):
    attn = "eager" if model_type == "gemma2" else "sdpa"
    model16 = build(model_type, torch.bfloat16, attn=attn)
    model32 = copy.deepcopy(model16).float()
    ids, pos, _ = packed_row()
    ref = step(model32, ids, pos)
    del model32
    stock = step(model16, ids, pos)
    assert apply_fast_paths(model16, FastPathConfig(), CUDA) == ALL_ON
    got = step(model16, ids, pos)
    assert_parity(got, stock, ref, slack=5e-3, limit=5e-2)


def test_packed_attention_and_checkpointing_qwen3():
    """The training configuration: varlen attention with collator metadata, non-reentrant
    checkpointing, bf16. Compared with stock HF + PEFT (sdpa, positions only)."""
    from engine.fastpath import attention, packed

    model16 = build("qwen3", torch.bfloat16, layers=4)
    model32 = copy.deepcopy(model16).float()
    ids, pos, lengths = packed_row()
    ref = step(model32, ids, pos)
    del model32
    stock = step(model16, ids, pos)
    assert attention.enable_packed_attention(model16) == "on"
    assert apply_fast_paths(model16, FastPathConfig(), CUDA) == ALL_ON
    model16.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model16.train()
    kwargs = packed.PackedSeqInfo.from_lengths(lengths).to(CUDA).model_kwargs()
    pos2 = kwargs.pop("position_ids")
    got = step(model16, ids, pos2, **kwargs)
    assert_parity(got, stock, ref, slack=5e-3, limit=5e-2)


def test_fused_paths_use_less_memory_qwen3():
    """Peak memory of forward+backward: patched <= stock (fewer saved activations)."""
    model = build("qwen3", torch.bfloat16, layers=4)
    ids, pos, _ = packed_row(total=8192)

    def peak():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(model, ids, pos)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    peak()  # warm-up (allocator, Triton compilation)
    stock = peak()
    apply_fast_paths(model, FastPathConfig(), CUDA)
    peak()
    patched = peak()
    print(f"peak stock {stock / 2**20:.0f} MiB, patched {patched / 2**20:.0f} MiB")
    assert patched <= stock


def test_no_host_sync_in_patched_decoder():
    """With collator metadata and the varlen attention, the patched decoder (forward and
    backward) never synchronizes with the host."""
    from engine.fastpath import attention, packed

    model = build("qwen3", torch.bfloat16)
    attention.enable_packed_attention(model)
    apply_fast_paths(model, FastPathConfig(), CUDA)
    ids, _, lengths = packed_row()
    kwargs = packed.PackedSeqInfo.from_lengths(lengths).to(CUDA).model_kwargs()
    decoder = model.get_base_model().model
    decoder(input_ids=ids, use_cache=False, **kwargs)  # warm-up: compilation, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = decoder(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
        hidden.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
