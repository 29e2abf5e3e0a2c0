"""QLoRA fast path: the fused LoRA Functions over bitsandbytes 4-bit (NF4) bases, on a CPU.

A tiny Qwen3 (bench.workloads.CPU_TINY) quantized with `quantize_nf4` and wrapped by
PEFT, which picks its bnb Linear4bit LoRA layer. The fast-path report says the LoRA paths are
on; one step's loss and LoRA gradients match PEFT's stock bitsandbytes path in fp32; every base
weight is dequantized once in forward and at most once in backward, and no dense copy outlives
its matmul; disabled or merged adapters fall back to the stock path; other quantized layers
keep PEFT's path with a readable reason.
"""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from bench.workloads import CPU_TINY, build_model, quantize_nf4  # noqa: E402
from engine.config import FastPathConfig, LoraConfig  # noqa: E402
from engine.fastpath import quant  # noqa: E402
from engine.fastpath.lora import lora_linears  # noqa: E402
from engine.fastpath.lora_group import lora_parts, lora_unsupported_reason, runtime_ok  # noqa: E402
from engine.models.lora import attach_lora  # noqa: E402
from engine.models.patches import FAST_PATHS, apply_fast_paths, remove_fast_paths  # noqa: E402

CPU = torch.device("cpu")
LENGTHS = (9, 6, 13)  # one packed row of three documents
ALL_ON = {k: "on" for k in FAST_PATHS}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOL = 1e-5  # fp32 on both paths: only the summation order of the same dequantized weights differs


def _tiny_model(seed=0):
    model = build_model(CPU_TINY, dtype=torch.float32, device=CPU, attn_implementation="eager", seed=seed)
    with torch.no_grad():  # random norm weights: all-ones would hide a missing scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def _attach(model):
    peft_model = attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))
    with torch.no_grad():  # PEFT starts B at zero, which would make dA and the LoRA dx zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    # Training mode, as in a run; in eval mode on an AVX512-BF16 CPU bitsandbytes repacks
    # weights for its inference kernel (the fused path then falls back, see test below).
    return peft_model.train()


def qlora_model(seed=0):
    model = _tiny_model(seed)
    quantize_nf4(model, compute_dtype=torch.float32)
    return _attach(model)


def int8_model(seed=0):
    """The same model with bitsandbytes 8-bit bases (PEFT wraps them in its Linear8bitLt)."""
    model = _tiny_model(seed)
    for parent in list(model.get_decoder().modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False, has_fp16_weights=False)
                q.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
                setattr(parent, name, q.to(CPU))
    model.is_loaded_in_8bit = True
    return _attach(model)


def layers(model):
    return model.get_base_model().get_decoder().layers


def projections(layer):
    return [getattr(layer.self_attn, n) for n in PROJ[:4]] + [getattr(layer.mlp, n) for n in PROJ[4:]]


def packed_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CPU_TINY.config["vocab_size"], (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def step(model, ids, pos, between=None):
    """Loss and LoRA gradients of one forward/backward; `between()` runs before backward."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    if between is not None:
        between()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    return loss.detach(), grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_step(got, ref, tol=TOL):
    (l1, g1), (l0, g0) = got, ref
    assert rel(l1, l0) <= tol, (l1.item(), l0.item())
    assert g1.keys() == g0.keys()
    worst = max(g0, key=lambda n: rel(g1[n], g0[n]))
    assert rel(g1[worst], g0[worst]) <= tol, (worst, rel(g1[worst], g0[worst]))


class BaseCalls:
    """Counts forward calls of the bitsandbytes base modules (the stock path runs them)."""

    def __init__(self, model):
        self.n = 0
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if quant.is_4bit(m)]
        assert self.handles

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        for h in self.handles:
            h.remove()


# -- the report ---------------------------------------------------------------------------------


def test_peft_wraps_nf4_bases_and_report_is_on():
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    model = qlora_model()
    for layer in layers(model):
        for proj in projections(layer):
            assert isinstance(proj, PeftLinear4bit)
            base = proj.get_base_layer()
            assert isinstance(base, bnb.nn.Linear4bit) and base.weight.quant_state.quant_type == "nf4"
            assert lora_unsupported_reason(proj) is None
    assert apply_fast_paths(model, FastPathConfig(), CPU) == ALL_ON


# -- parity with PEFT's stock bitsandbytes path, and what stays in memory ----------------------------


def test_fused_step_matches_peft_stock_and_drops_dequantized_weights(monkeypatch):
    model = qlora_model()
    ids, pos = packed_batch()
    ref = step(model, ids, pos)
    assert any("lora_A" in n and g.abs().max() > 0 for n, g in ref[1].items())
    assert apply_fast_paths(model, FastPathConfig(), CPU) == ALL_ON

    phase = ["forward"]
    calls: Counter = Counter()
    alive: list = []
    real = quant.dequantize

    def counting(layer, dtype):
        w = real(layer, dtype)
        calls[phase[0], id(layer)] += 1
        alive.append(weakref.ref(w))
        return w

    def live():
        return sum(r() is not None for r in alive)

    def after_forward():
        # Nothing dequantized in forward is kept for backward (ctx, caches or saved tensors).
        assert live() == 0
        phase[0] = "backward"

    monkeypatch.setattr(quant, "dequantize", counting)
    base_calls = BaseCalls(model)
    got = step(model, ids, pos, between=after_forward)
    base_calls.remove()
    assert_same_step(got, ref)
    assert base_calls.n == 0  # the fused Functions ran, not bitsandbytes' matmul
    assert live() == 0

    bases = [
        (i, n, proj.get_base_layer())
        for i, layer in enumerate(layers(model))
        for n, proj in zip(PROJ, projections(layer))
    ]
    for i, name, base in bases:
        assert calls["forward", id(base)] == 1, (i, name)
        # Once more for dx = dy W, except where no gradient flows into the input: layer 0's
        # q/k/v read the normed embeddings, and neither the embeddings nor the norms train.
        expected = 0 if (i == 0 and name in ("q_proj", "k_proj", "v_proj")) else 1
        assert calls["backward", id(base)] == expected, (i, name)
    assert sum(calls.values()) == 2 * len(bases) - 3


def test_fused_step_with_gradient_checkpointing():
    model = qlora_model()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, pos = packed_batch()
    ref = step(model, ids, pos)
    assert apply_fast_paths(model, FastPathConfig(), CPU) == ALL_ON
    assert_same_step(step(model, ids, pos), ref)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bare_4bit_projection_with_bias(quant_type):
    """A projection LoRA does not target (the bare Linear4bit, with a bias) against its own
    stock forward, for both 4-bit codes bitsandbytes dequantizes."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 96)
    layer = bnb.nn.Linear4bit(64, 96, bias=True, compute_dtype=torch.float32, quant_type=quant_type, device="meta")
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type=quant_type, module=layer)
    layer.bias = nn.Parameter(dense.bias.data, requires_grad=False)
    layer.weight = layer.weight.to(CPU)  # quantizes
    layer.train()
    parts = [lora_parts(layer)]
    assert parts[0].adapter is None
    x = torch.randn(2, 7, 64)
    dy = torch.randn(2, 7, 96)

    def run(fn):
        xr = x.clone().requires_grad_(True)
        y = fn(xr)
        y.backward(dy)
        return y.detach(), xr.grad

    (y0, dx0), (y1, dx1) = run(layer), run(lambda t: lora_linears(t, parts)[0])
    assert rel(y1, y0) <= TOL and rel(dx1, dx0) <= TOL
    # The 4-bit layer really is approximate: the check is not comparing dense weights.
    assert rel(y0, dense(x).detach()) > 1e-3


# -- per-call fallbacks ----------------------------------------------------------------------------


def test_disabled_adapters_stay_on_the_fused_path():
    """PEFT's disable_adapter() (the reference pass of DPO, KTO and GRPO) runs the 4-bit base
    alone on the fused path: no projection goes through bitsandbytes' modules, and the loss is
    the stock path's with the adapters off."""
    model = qlora_model()
    ids, pos = packed_batch()
    with model.disable_adapter():
        ref = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.detach()
    enabled = step(model, ids, pos)[0]
    apply_fast_paths(model, FastPathConfig(), CPU)
    base_calls = BaseCalls(model)
    with torch.no_grad(), model.disable_adapter():
        got = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    base_calls.remove()
    assert base_calls.n == 0  # every projection on the fused path, none through bitsandbytes' forward
    assert rel(got, ref) <= TOL
    assert rel(enabled, ref) > 1e-4  # the adapters do change the loss
    assert rel(step(model, ids, pos)[0], enabled) <= TOL  # and the adapters are back after


def test_merged_adapter_takes_the_stock_path():
    model = qlora_model()
    ids, pos = packed_batch()
    assert apply_fast_paths(model, FastPathConfig(), CPU) == ALL_ON
    q0 = layers(model)[0].self_attn.q_proj
    parts = [lora_parts(q0)]
    q0.merge()  # after planning: the per-call check must notice
    assert not runtime_ok(parts, torch.zeros(1, 64))
    got = step(model, ids, pos)
    assert not any(".layers.0.self_attn.q_proj." in n for n in got[1])  # merged: no LoRA grads
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    assert report["lora_qkv"] == "partial 1/2: adapter is merged into the base weight"
    assert report["lora_o"] == report["lora_mlp"] == "on"
    assert_same_step(step(model, ids, pos), got)
    remove_fast_paths(model)
    assert_same_step(step(model, ids, pos), got)


def test_runtime_check_uses_the_4bit_compute_dtype():
    model = qlora_model()
    parts = [lora_parts(p) for p in projections(layers(model)[0])[:3]]
    x = torch.randn(3, 64)
    assert runtime_ok(parts, x)
    assert not runtime_ok(parts, x.bfloat16())  # bitsandbytes would compute in fp32
    assert not runtime_ok(parts, x.double())
    with model.disable_adapter():
        assert runtime_ok(parts, x)  # the reference pass stays on the fused path (the base alone)
    # bitsandbytes' CPU inference repacking changes the weight layout: back to the stock path.
    base = parts[0].base
    base.weight.quant_state.packing_format_for_cpu = True
    try:
        assert not runtime_ok(parts, x)
        assert "repacked" in lora_unsupported_reason(parts[0].layer)
    finally:
        base.weight.quant_state.packing_format_for_cpu = False


# -- what keeps PEFT's path --------------------------------------------------------------------------


def test_8bit_bases_keep_peft_path_with_reason():
    model = int8_model()
    proj = layers(model)[0].self_attn.q_proj
    assert type(proj).__name__ == "Linear8bitLt" and "bnb" in type(proj).__module__
    reason = lora_unsupported_reason(proj)
    assert "Linear8bitLt" in reason and "4-bit" in reason
    with pytest.raises(ValueError, match="Linear8bitLt"):
        lora_parts(proj)
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    for key in ("lora_qkv", "lora_o", "lora_mlp"):
        assert report[key] == f"off: {reason}"
    assert report["rmsnorm"] == report["rope"] == "on"
    assert torch.isfinite(step(model, *packed_batch())[0])  # PEFT's 8-bit path still trains


def test_unsupported_bases_report_reasons():
    unquantized = bnb.nn.Linear4bit(64, 64, quant_type="nf4")  # quantized only when moved
    assert "not quantized" in lora_unsupported_reason(unquantized)
    assert "Linear8bitLt" in lora_unsupported_reason(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False))

    class CustomLinear(nn.Linear):
        pass

    reason = lora_unsupported_reason(CustomLinear(4, 4))
    assert "CustomLinear" in reason and "neither a dense nn.Linear nor a 4-bit" in reason
    assert "not a PEFT" in lora_unsupported_reason(nn.Conv1d(2, 2, 1))
