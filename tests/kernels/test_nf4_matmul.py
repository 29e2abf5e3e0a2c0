"""The NF4 matmul that decodes the 4-bit weight inside the kernel, through Triton's interpreter on a
CPU: x @ W.T (forward) and dy @ W (input gradient), fresh or added onto an existing output, against
the same product over bitsandbytes' own dequantized weight. fp32 and fp16 only: the interpreter's
bf16 tl.dot is broken on Triton 3.9 (bf16 runs on the GPU, tests/gpu/test_nf4_gpu.py)."""

import os

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from engine.counters import reset_counters  # noqa: E402
from engine.kernels.nf4_dequant import NF4Weight  # noqa: E402
from engine.kernels.nf4_matmul import (  # noqa: E402
    nf4_matmul,
    nf4_matmul_reference,
    nf4_matmul_supported,
    nf4_matmul_triton,
)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-2)}


def weight(rows, cols, dtype, nested=True, blocksize=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    return NF4Weight.from_bnb(packed, state), bnbf.dequantize_4bit(packed, state)


def act(m, k, dtype, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("transpose", [True, False], ids=["x_Wt", "dy_W"])
@pytest.mark.parametrize(
    "m,rows,cols,dtype,nested,blocksize",
    [
        (37, 80, 192, torch.float32, True, 64),  # partial tiles along every dimension
        (20, 64, 256, torch.float16, True, 64),
        (16, 48, 128, torch.float32, False, 64),
        (24, 32, 256, torch.float16, True, 128),
    ],
)
def test_matches_bnb_dequantized_product(transpose, m, rows, cols, dtype, nested, blocksize):
    w, dense = weight(rows, cols, dtype, nested, blocksize, seed=m)
    a = act(m, cols if transpose else rows, dtype)
    assert nf4_matmul_supported(w, a, transpose) is None
    want = a.double() @ (dense.t() if transpose else dense).double()
    reset_counters()
    got = nf4_matmul_triton(a, w, transpose)
    assert reset_counters().get("nf4_matmul:triton") == 1
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("transpose", [True, False], ids=["x_Wt", "dy_W"])
def test_accumulates_into_a_strided_output(transpose):
    dtype = torch.float32
    w, dense = weight(96, 192, dtype, seed=3)
    m = 40
    # Activations as a column slice of a wider tensor, output as a row slice: both strided.
    k = 192 if transpose else 96
    a = act(m, k + 8, dtype)[:, 4 : 4 + k]
    n = 96 if transpose else 192
    big = act(m + 10, n, dtype, seed=7)
    out = big[5 : 5 + m]
    before = big.clone()
    nf4_matmul_triton(a, w, transpose, out=out, accumulate=True)
    want = before[5 : 5 + m] + a @ (dense.t() if transpose else dense)
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert torch.equal(big[:5], before[:5]) and torch.equal(big[5 + m :], before[5 + m :])


@pytest.mark.parametrize("transpose", [True, False], ids=["x_Wt", "dy_W"])
def test_wide_tiles_span_several_quantization_blocks(transpose):
    # 128-wide tiles along W's columns hold two 64-value blocks each (the GPU's backward tile);
    # 192 columns leave the last tile half outside the row.
    dtype = torch.float32
    w, dense = weight(64, 192, dtype, seed=4)
    a = act(17, 192 if transpose else 64, dtype)
    got = nf4_matmul_triton(a, w, transpose, config=(16, 128, 128, 4, 1))
    torch.testing.assert_close(got, a @ (dense.t() if transpose else dense), **TOL[dtype])


def test_reference_and_dispatch_on_cpu():
    w, dense = weight(64, 128, torch.float32, seed=2)
    a = act(9, 128, torch.float32)
    reset_counters()
    y = nf4_matmul(a, w)  # a CPU tensor: the dispatcher takes the reference
    assert reset_counters().get("nf4_matmul:torch") == 1
    torch.testing.assert_close(y, a @ dense.t())
    out = torch.ones(9, 64)
    nf4_matmul_reference(a, w, out=out, accumulate=True)
    torch.testing.assert_close(out, 1 + a @ dense.t())


def test_supported_says_why_not():
    w, _ = weight(64, 128, torch.float32)
    assert "float64" in nf4_matmul_supported(w, act(4, 128, torch.float64), True)
    with pytest.raises(ValueError, match="W is"):
        nf4_matmul_supported(w, act(4, 64, torch.float32), True)
    # Quantization blocks that straddle rows (96 columns, blocksize 64) cannot be tiled per row.
    w2, _ = weight(4, 96, torch.float32)
    assert "quantization blocks" in nf4_matmul_supported(w2, act(4, 96, torch.float32), True)
