"""[dy | dy b | 0] in one pass over dy (engine.kernels.wide_rows) through the interpreter on a CPU,
against the float64 product: rows and columns that are not block multiples, a rank below the dot's 16
with alignment columns after it, a strided dy (a column slice of a wider buffer), no rows. bf16 dots
run only on the GPU (tests/gpu/test_kernels_gpu.py)."""

import pytest
import torch

from engine.kernels import wide_rows as W


@pytest.mark.parametrize(
    "rows,out,rank,width,dtype",
    [
        (150, 200, 4, 8, torch.float32),  # ragged rows and columns; 4 alignment columns
        (64, 128, 16, 16, torch.float16),  # whole blocks, no alignment columns
        (70, 96, 12, 16, torch.float16),
    ],
)
def test_matches_the_product_and_copies_dy_exactly(rows, out, rank, width, dtype):
    g = torch.Generator().manual_seed(rows)
    dy = (torch.randn(rows, out + 24, generator=g) / 4).to(dtype)[:, 24:]  # strided rows
    b = (torch.randn(out, rank, generator=g) / 4).to(dtype)
    got = W.wide_rows_triton(dy, b, width)
    assert got.shape == (rows, out + width) and got.dtype == dtype
    assert torch.equal(got[:, :out], dy)
    want = dy.double() @ b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[:, out : out + rank].double(), want, rtol=tol, atol=tol)
    assert not got[:, out + rank :].any()  # alignment columns: zero, never garbage
    ref = W.wide_rows_reference(dy, b, width)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_no_rows_and_bad_shapes():
    assert W.wide_rows_triton(torch.zeros(0, 32), torch.zeros(32, 8), 8).shape == (0, 40)
    with pytest.raises(ValueError, match="wide_rows: dy"):
        W.wide_rows_triton(torch.zeros(5, 32), torch.zeros(30, 8), 8)
    with pytest.raises(ValueError, match="narrower than the rank"):
        W.wide_rows_triton(torch.zeros(5, 32), torch.zeros(32, 16), 8)


def test_off_cuda_the_dispatcher_runs_the_reference():
    g = torch.Generator().manual_seed(0)
    dy, b = torch.randn(40, 48, generator=g), torch.randn(48, 8, generator=g)
    torch.testing.assert_close(W.wide_rows(dy, b, 8), torch.cat([dy, dy @ b], 1))
