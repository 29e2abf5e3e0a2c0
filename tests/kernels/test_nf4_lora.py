"""The fused LoRA Functions over NF4 bases with the weight decoded inside the matmul (the NF4 kernel
through Triton's interpreter, nf4="triton") against the same Functions dequantizing first
(nf4="off"): outputs and every gradient (x, A, B), for q/k/v-style groups and the gated MLP,
its down projection sliced over rows. fp32 on a CPU (the interpreter's bf16 tl.dot is broken)."""

import os

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft_bnb = pytest.importorskip("peft.tuners.lora.bnb")

from peft import LoraConfig as PeftLoraConfig  # noqa: E402

from engine.counters import reset_counters  # noqa: E402
from engine.fastpath import lora as L  # noqa: E402
from engine.fastpath.lora import GatedAct, lora_linears, lora_mlp  # noqa: E402
from engine.fastpath.lora_group import LoRAGroup, lora_parts  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU")


def nf4_lora(in_f, out_f, seed, bias=False):
    """PEFT's LoRA layer over a bitsandbytes NF4 (double quant) base, fp32 compute, B nonzero."""
    torch.manual_seed(seed)
    base = bnb.nn.Linear4bit(
        in_f, out_f, bias=bias, compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4", device="meta"
    )
    base.weight = bnb.nn.Params4bit(
        torch.randn(out_f, in_f) * 0.1, requires_grad=False, quant_type="nf4", compress_statistics=True, module=base
    )
    if bias:
        base.bias = torch.nn.Parameter(torch.randn(out_f) * 0.1, requires_grad=False)
    base.weight = base.weight.to("cpu")  # quantizes here
    layer = peft_bnb.Linear4bit(base, "default", PeftLoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.2)
    return layer.train()


def grads(fn, x, layers):
    x = x.clone().requires_grad_()
    for layer in layers:
        for m in (layer.lora_A["default"], layer.lora_B["default"]):
            m.weight.grad = None
    y = fn(x)
    ys = y if isinstance(y, tuple) else (y,)
    g = torch.Generator().manual_seed(9)
    sum((t * torch.randn(t.shape, generator=g)).sum() for t in ys).backward()
    out = [t.detach() for t in ys] + [x.grad]
    for layer in layers:
        out += [layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_qkv_group_with_bias():
    q, k, v = nf4_lora(128, 128, 1, bias=True), nf4_lora(128, 64, 2), nf4_lora(128, 64, 3)
    x = torch.randn(37, 128)
    parts = [lora_parts(m) for m in (q, k, v)]
    want = grads(lambda t: lora_linears(t, LoRAGroup(parts, nf4="off")), x, (q, k, v))
    reset_counters()
    got = grads(lambda t: lora_linears(t, LoRAGroup(parts, nf4="triton")), x, (q, k, v))
    counts = reset_counters()
    # Three products in forward, three input-gradient products in backward, all in the kernel.
    assert counts.get("nf4_matmul:triton") == 6
    assert not any(k.startswith("fallback:") for k in counts)
    assert_same(got, want)


def test_gated_mlp_sliced_over_rows(monkeypatch):
    # Slices of 256 rows: the down projection runs per slice in forward and backward.
    monkeypatch.setattr(L, "MLP_SLICE_BYTES", 256 * 192 * 4)
    gate, up, down = nf4_lora(64, 192, 4), nf4_lora(64, 192, 5), nf4_lora(192, 64, 6)
    x = torch.randn(600, 64)
    act = GatedAct("silu")

    def run(mode):
        gu = LoRAGroup([lora_parts(gate), lora_parts(up)], nf4=mode)
        dn = LoRAGroup([lora_parts(down)], nf4=mode)
        return grads(lambda t: lora_mlp(t, gu, dn, act=act), x, (gate, up, down))

    want = run("off")
    reset_counters()
    got = run("triton")
    counts = reset_counters()
    # gate and up once each forward and backward; down once per slice (3) forward and backward.
    assert counts.get("nf4_matmul:triton") == 2 + 2 + 3 + 3
    assert_same(got, want)


def test_fp4_base_falls_back_with_its_reason():
    layer = nf4_lora(64, 64, 7)
    base = layer.get_base_layer()
    w = torch.randn(64, 64) * 0.1
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="fp4")
    base.weight.data, base.weight.quant_state = packed, state
    x = torch.randn(8, 64)
    reset_counters()
    (y,) = lora_linears(x, LoRAGroup([lora_parts(layer)], nf4="triton"))
    counts = reset_counters()
    assert counts.get("fallback:nf4_matmul: 4-bit quant type 'fp4'; the kernel decodes nf4") == 1
    assert "nf4_matmul:triton" not in counts
    dense = bnb.functional.dequantize_4bit(packed, state)
    xa = x @ layer.lora_A["default"].weight.t()
    want = x @ dense.t() + xa @ layer.lora_B["default"].weight.t() * 2.0
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
