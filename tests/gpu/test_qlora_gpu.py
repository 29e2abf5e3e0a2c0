"""GPU parity and memory of the QLoRA fast path: fused LoRA Functions over bitsandbytes NF4 bases.

A Llama of TinyLlama's layer shape (hidden 2048, intermediate 5632, 32 heads, 4 KV heads) with
two decoder layers and a small vocabulary, bf16, every decoder Linear quantized to NF4 (double
quant) by bench.workloads.quantize_nf4, LoRA r=16 on all projections (fp32 adapters, as
PEFT makes them), one packed row of 4096 tokens. Fused vs PEFT's stock bitsandbytes path on the
same quantized model: loss and every LoRA gradient within 5e-2 (norm-wise relative), the fused
error against an fp32-compute reference (same NF4 weights) no worse than twice the stock one,
and the fused step's peak memory not above the stock step's. Run: pytest -m gpu tests/gpu
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import FastPathConfig, LoraConfig
from engine.models.patches import apply_fast_paths, remove_fast_paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
]

CUDA = torch.device("cuda")
LORA_PATHS = ("lora_qkv", "lora_o", "lora_mlp")
VOCAB = 8192
# Fused vs stock, both bf16: norm-wise relative difference of loss and LoRA grads. Each path is
# 1-2e-2 from the fp32 reference (bf16 activations through the whole model; measured on CPU at
# hidden 512, 1024 tokens: 1.7e-2 each, 1.9e-2 apart), independently, so 2e-2 would be flaky;
# the sharper test is the 2x-of-stock bound against fp32 below (the limit of test_patches_gpu).
LIMIT = 5e-2


def build(layers=2, seed=0):
    """The quantized bf16 model with LoRA attached (PEFT's bnb Linear4bit layers), B nonzero."""
    from bench.workloads import quantize_nf4
    from engine.models.lora import attach_lora

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    cfg.use_cache = False
    torch.manual_seed(seed)
    with torch.device(CUDA):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    quantize_nf4(model, compute_dtype=torch.bfloat16)
    model = attach_lora(model, LoraConfig(r=16, alpha=16.0, dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():  # PEFT starts B at zero, which would make dA and the LoRA dx zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(proj).__module__.startswith("peft.tuners.lora.bnb"), type(proj)
    return model.train()


def packed_row(total=4096, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(torch.empty(1).log_normal_(5.3, 0.7, generator=g).clamp(16, 2048))
        lengths.append(min(n, total - sum(lengths)))
    ids = torch.randint(0, VOCAB, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids.to(CUDA), pos.to(CUDA)


def step(model, ids, pos):
    """(loss, LoRA grads in fp32, peak bytes of forward+backward above what was allocated before)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads, peak


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def to_fp32_compute(model):
    """The same NF4 weights computed in fp32: float non-quantized weights, fp32 compute dtype."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = torch.float32
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def test_qlora_grads_match_stock_bf16():
    model = build()
    ids, pos = packed_row()
    step(model, ids, pos)  # warm-up
    stock = step(model, ids, pos)
    report = apply_fast_paths(model, FastPathConfig(), CUDA)
    assert {k: report[k] for k in LORA_PATHS} == {k: "on" for k in LORA_PATHS}, report
    got = step(model, ids, pos)

    assert rel(got[0], stock[0]) <= LIMIT, (got[0].item(), stock[0].item())
    errors = {n: rel(got[1][n], stock[1][n]) for n in stock[1]}
    worst = max(errors, key=errors.get)
    print(f"loss {got[0].item():.5f} vs stock {stock[0].item():.5f}; worst grad {worst}: {errors[worst]:.2e}")
    assert errors[worst] <= LIMIT, (worst, errors[worst])

    # Against the same NF4 weights computed in fp32 (stock path, adapters unchanged): the fused
    # bf16 path may be at most twice as far off as PEFT's own bf16 path, plus a little slack.
    remove_fast_paths(model)
    ref = step(to_fp32_compute(model), ids, pos)
    assert rel(got[0], ref[0]) <= 2 * rel(stock[0], ref[0]) + 5e-3
    for n in ref[1]:
        e_got, e_stock = rel(got[1][n], ref[1][n]), rel(stock[1][n], ref[1][n])
        assert e_got <= 2 * e_stock + 5e-3, (n, e_got, e_stock)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_qlora_peak_memory_not_above_stock(checkpointing):
    """Dequantized weights are dropped after each matmul (never saved for backward), and the
    fused Functions save fewer activations than PEFT's per-op autograd."""
    model = build()
    if checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, pos = packed_row()
    step(model, ids, pos)  # warm-up: cuBLAS workspaces, bitsandbytes kernels
    stock = step(model, ids, pos)[2]
    report = apply_fast_paths(model, FastPathConfig(), CUDA)
    assert all(report[k] == "on" for k in LORA_PATHS), report
    step(model, ids, pos)  # warm-up: Triton compilation, the adapter weight cache
    fused = step(model, ids, pos)[2]
    print(f"peak above start: stock {stock / 2**20:.0f} MiB, fused {fused / 2**20:.0f} MiB")
    assert fused <= stock
