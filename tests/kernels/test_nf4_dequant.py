"""NF4 dequantization: the Triton kernel (through the interpreter on a CPU) and the torch reference
against bitsandbytes' own `dequantize_4bit`, bit for bit, with and without double quantization."""

import os

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from engine.counters import reset_counters  # noqa: E402
from engine.kernels.nf4_dequant import (  # noqa: E402
    NF4Weight,
    dequantize_nf4,
    dequantize_nf4_reference,
    dequantize_nf4_triton,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def quantized(rows, cols, dtype, nested=True, blocksize=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: the nested absmax codes then span their whole range.
    w = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[:, None]).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    return packed, state


def expected(packed, state):
    return bnbf.dequantize_4bit(packed, state)


@pytest.mark.parametrize(
    "rows,cols,dtype,nested,blocksize",
    [
        (48, 256, torch.bfloat16, True, 64),
        (33, 320, torch.float16, True, 64),  # 33 * 320 / 64 = 165 absmax values: a partial nested block
        (40, 192, torch.float32, True, 64),
        (24, 512, torch.bfloat16, False, 64),
        (16, 256, torch.bfloat16, True, 128),
    ],
)
def test_reference_is_bit_exact(rows, cols, dtype, nested, blocksize):
    packed, state = quantized(rows, cols, dtype, nested, blocksize)
    got = dequantize_nf4_reference(NF4Weight.from_bnb(packed, state))
    want = expected(packed, state)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize(
    "rows,cols,dtype,nested",
    [
        (48, 256, torch.bfloat16, True),
        (33, 320, torch.float16, True),
        (40, 192, torch.float32, True),
        (24, 512, torch.bfloat16, False),
        (29, 4160, torch.bfloat16, True),  # 60,320 values: several programs, the last one partial
    ],
)
def test_triton_is_bit_exact(rows, cols, dtype, nested):
    packed, state = quantized(rows, cols, dtype, nested, seed=rows)
    w = NF4Weight.from_bnb(packed, state)
    reset_counters()
    got = dequantize_nf4_triton(w)
    assert reset_counters().get("nf4_dequant:triton") == 1
    assert torch.equal(got, expected(packed, state))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 on a CPU")
def test_triton_odd_element_count():
    # 7 x 50 = 350 values: not whole blocks, and bnb's packed tensor ends in a full byte.
    packed, state = quantized(7, 50, torch.float32, nested=True, seed=5)
    assert torch.equal(dequantize_nf4_triton(NF4Weight.from_bnb(packed, state)), expected(packed, state))


def test_dispatch_runs_reference_on_cpu():
    packed, state = quantized(16, 128, torch.bfloat16)
    reset_counters()
    out = dequantize_nf4(NF4Weight.from_bnb(packed, state))
    assert reset_counters().get("nf4_dequant:torch") == 1
    assert torch.equal(out, expected(packed, state))


def test_rejects_fp4():
    w = torch.randn(8, 64)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="fp4")
    with pytest.raises(ValueError, match="nf4"):
        NF4Weight.from_bnb(packed, state)
