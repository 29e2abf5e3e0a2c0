"""The NF4 kernels on the GPU at the shapes of W4 (Qwen3-14B) and W8 (Qwen3-4B, Qwen3-8B), in bf16.

- Dequantization is bit-identical to bitsandbytes' CUDA `dequantize_4bit` for every projection.
- The fused matmul (W decoded inside the kernel) matches dequantize + cuBLAS: x @ W.T and dy @ W,
  fresh and added onto an existing output, its error against an fp64 product of the same
  dequantized weight no worse than cuBLAS's own bf16 error (plus rounding slack).
- It allocates nothing the size of W: its peak above its inputs is its output.
- A QLoRA training step through the fused LoRA Functions with fast_paths.nf4_matmul true runs the
  kernel (counted, no fallback), matches the same step with it off, and peaks no higher.

Run: pytest -m gpu tests/gpu/test_nf4_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
]

CUDA = torch.device("cuda")
MODELS = {  # hidden, intermediate, heads, kv heads, head dim (public configs)
    "qwen3-14b": (5120, 17408, 40, 8, 128),
    "qwen3-4b": (2560, 9728, 32, 8, 128),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
}


def shapes():
    out = []
    for model, (hidden, inter, heads, kv, d) in MODELS.items():
        for name, shape in {
            "q": (heads * d, hidden),
            "kv": (kv * d, hidden),
            "o": (hidden, heads * d),
            "gate_up": (inter, hidden),
            "down": (hidden, inter),
        }.items():
            out.append(pytest.param(shape, id=f"{model}-{name}-{shape[0]}x{shape[1]}"))
    return out


def quantized(shape, seed=0):
    import bitsandbytes.functional as bnbf

    from engine.kernels.nf4_dequant import NF4Weight

    g = torch.Generator(device=CUDA).manual_seed(seed)
    w = (torch.randn(shape, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return packed, state, NF4Weight.from_bnb(packed, state)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", shapes())
def test_dequant_bit_exact_with_bnb(shape):
    import bitsandbytes.functional as bnbf

    from engine.kernels.nf4_dequant import dequantize_nf4_triton

    packed, state, w = quantized(shape)
    assert state.nested and state.blocksize == 64
    assert torch.equal(dequantize_nf4_triton(w), bnbf.dequantize_4bit(packed, state))


@pytest.mark.parametrize("shape", shapes())
def test_fused_matmul_matches_dequantize_then_cublas(shape):
    import bitsandbytes.functional as bnbf

    from engine.kernels.nf4_matmul import nf4_matmul_supported, nf4_matmul_triton

    packed, state, w = quantized(shape, seed=1)
    dense = bnbf.dequantize_4bit(packed, state)
    m = 1000  # not a multiple of any tile: the last row-tile is partial
    g = torch.Generator(device=CUDA).manual_seed(2)
    for transpose in (True, False):
        a = torch.randn(m, shape[1] if transpose else shape[0], device=CUDA, generator=g).to(torch.bfloat16)
        b = dense.t() if transpose else dense
        assert nf4_matmul_supported(w, a, transpose) is None
        exact = a.double() @ b.double()
        stock = torch.mm(a, b)
        got = nf4_matmul_triton(a, w, transpose)
        e_got, e_stock = rel(got, exact), rel(stock, exact)
        assert e_got <= 1.5 * e_stock + 1e-4, (transpose, e_got, e_stock)
        # Added onto an existing output (the LoRA term first, as addmm_ does).
        c0 = torch.randn(m, b.shape[1], device=CUDA, generator=g).to(torch.bfloat16)
        out = c0.clone()
        nf4_matmul_triton(a, w, transpose, out=out, accumulate=True)
        stock_acc = c0.clone().addmm_(a, b)
        exact_acc = exact + c0.double()
        assert rel(out, exact_acc) <= 1.5 * rel(stock_acc, exact_acc) + 1e-4, transpose


def test_fused_matmul_writes_no_dense_weight():
    from engine.kernels.nf4_matmul import nf4_matmul_triton

    packed, state, w = quantized((17408, 5120), seed=3)  # W4's gate/up: 170 MiB as bf16
    a = torch.randn(2048, 5120, device=CUDA, dtype=torch.bfloat16)
    nf4_matmul_triton(a, w, True)  # compile first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = nf4_matmul_triton(a, w, True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= y.numel() * y.element_size() + 2**20, extra / 2**20


def test_qlora_step_runs_the_kernel_and_matches_it_off():
    """Two decoder layers of TinyLlama's shape (tests/gpu/test_qlora_gpu.py's model), one packed
    row of 4,096 tokens: the step with nf4_matmul on against the same model with it off."""
    from test_qlora_gpu import LIMIT, build, packed_row, rel, step

    from engine.config import FastPathConfig
    from engine.counters import reset_counters, split_counts
    from engine.models.patches import apply_fast_paths

    model = build()
    ids, pos = packed_row()
    apply_fast_paths(model, FastPathConfig(nf4_matmul=False), CUDA)
    step(model, ids, pos)  # warm-up
    off = step(model, ids, pos)
    apply_fast_paths(model, FastPathConfig(nf4_matmul=True), CUDA)
    step(model, ids, pos)  # warm-up: Triton compilation
    reset_counters()
    on = step(model, ids, pos)
    calls, fallbacks = split_counts(reset_counters())
    print(f"counts {calls}; fallbacks {fallbacks}; peak off {off[2] / 2**20:.0f} MiB, on {on[2] / 2**20:.0f} MiB")
    assert calls.get("nf4_matmul:triton", 0) > 0
    assert not any(k.startswith("nf4_matmul") for k in fallbacks), fallbacks
    assert rel(on[0], off[0]) <= LIMIT
    for n in off[1]:
        assert rel(on[1][n], off[1][n]) <= LIMIT, n
    assert on[2] <= off[2]
