"""Matmuls with a bitsandbytes NF4 weight decoded inside the kernel: no dense copy of W is written.

For a 4-bit base W [rows, cols] (an nn.Linear weight: [out, in]) the fused LoRA Functions need

    forward:   C = A @ W.T     A [M, cols]  -> C [M, rows]     (x W^T)
    backward:  C = A @ W       A [M, rows]  -> C [M, cols]     (dy W, the input gradient)

optionally added onto an existing C (the LoRA term computed first, as `addmm_` does). Each
program computes one [BLOCK_M, BLOCK_N] tile of C and, for every step along the reduction,
decodes the [BLOCK_N, BLOCK_K] (forward) or [BLOCK_K, BLOCK_N] (backward) tile of W it needs
from the packed bytes into registers (engine.kernels.nf4_dequant.nf4_tile, bit-identical to
bitsandbytes' dequantize_4bit), then feeds it to `tl.dot` with fp32 accumulation. The packed
weight is a quarter of the bf16 bytes, and nothing the size of W is ever allocated.

The price: every row-tile of A decodes W again (M / BLOCK_M times), where dequantize + cuBLAS
decodes it once and writes/reads a dense copy. On the H200 (2026-12-01, bench.nf4_micro,
docs/gpu-test-log.md) this kernel ran at ~45-50 TFLOP/s, 3.5-18x slower than dequantize +
cuBLAS at every W4/W8 shape (M 2,048-16,384; the gap widest at large M), for 20-80% less peak memory per product; so the
engine uses it only when fast_paths.nf4_matmul is true. `nf4_matmul_supported` says when the
kernel applies at all.

Public: `nf4_matmul` (dispatcher: Triton on CUDA, the reference elsewhere), `nf4_matmul_triton`
(any device; on a CPU through TRITON_INTERPRET=1), `nf4_matmul_reference` (dequantize, then
torch.mm), `nf4_matmul_supported`. No autograd here: the LoRA Functions that call it own their
backward (W is frozen; its gradient is never needed).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.counters import count
from engine.kernels._common import jit, on_cuda, tl, triton
from engine.kernels.nf4_dequant import NF4Weight, dequantize_nf4, nf4_tile

_TL_DTYPES = {} if tl is None else {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@jit
def _nf4_mm_kernel(
    A,
    P,
    CODE,
    ABSMAX,
    ABSMAX2,
    CODE2,
    OFFSET,
    C,
    M,
    N,
    K,
    W_COLS,
    stride_am,
    stride_ak,
    stride_cm,
    stride_cn,
    TRANS_W: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BS: tl.constexpr,
    BS2: tl.constexpr,
    NESTED: tl.constexpr,
    IEEE: tl.constexpr,
    BITWISE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # C [M, N] = A [M, K] @ B [K, N], B = W.T (TRANS_W) or W, decoded tile by tile.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row-tiles walk the column tiles together, so a decoded column of
    # W tiles is reused from L2 by neighbours rather than fetched again.
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = A + offs_m[:, None].to(tl.int64) * stride_am
    out_dtype = C.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if TRANS_W:
            # W rows are C's columns, W's columns the reduction: the tile is [BLOCK_N, BLOCK_K].
            w = nf4_tile(
                P,
                CODE,
                ABSMAX,
                ABSMAX2,
                CODE2,
                OFFSET,
                offs_n,
                n_mask,
                k0,
                W_COLS,
                BLOCK_K,
                BS,
                BS2,
                NESTED,
                out_dtype,
                BITWISE_BF16,
            )
            b = tl.trans(w)
        else:
            # W rows are the reduction, W's columns C's columns: the tile is [BLOCK_K, BLOCK_N].
            b = nf4_tile(
                P,
                CODE,
                ABSMAX,
                ABSMAX2,
                CODE2,
                OFFSET,
                offs_k,
                k_mask,
                pid_n * BLOCK_N,
                W_COLS,
                BLOCK_N,
                BS,
                BS2,
                NESTED,
                out_dtype,
                BITWISE_BF16,
            )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(out_dtype), mask=c_mask)


# Tile candidates (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per direction, timed by
# Triton's autotuner once per (M, N, K, direction, accumulate) on the GPU (docs/gpu-test-log.md
# has what the H200 picked at W4's and W8's shapes). Along W's columns (BLOCK_K forward,
# BLOCK_N backward) a tile spans whole 64-value quantization blocks or lies inside one.
CANDIDATES = {
    "t": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4)],  # A @ W.T
    "n": [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (256, 128, 32, 8, 3), (64, 128, 64, 4, 4)],  # A @ W
}
_INTERPRET_CONFIG = (16, 64, 64, 4, 1)  # small tiles keep the interpreter quick
_TUNED: dict = {}


def _tuned(direction: str, accumulate: bool):
    """The kernel under Triton's autotuner for one direction (built on first use, on CUDA)."""
    if (direction, accumulate) not in _TUNED:
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in CANDIDATES[direction]
        ]
        # Timing a config must not leave its sum in an output it adds onto; a fresh output
        # needs no copy (that copy would be as large as the output, at the first step's peak).
        restore = ["C"] if accumulate else None
        tuner = triton.autotune(configs, key=["M", "N", "K"], restore_value=restore)(_nf4_mm_kernel)
        _TUNED[direction, accumulate] = tuner
    return _TUNED[direction, accumulate]


def chosen_config(transpose: bool, accumulate: bool = False) -> Optional[str]:
    """The autotuner's last pick for a direction (for benchmark records), None before any."""
    best = getattr(_TUNED.get(("t" if transpose else "n", accumulate)), "best_config", None)
    return None if best is None else str(best)


def nf4_matmul_supported(w: NF4Weight, a: torch.Tensor, transpose: bool) -> Optional[str]:
    """None when the kernel can compute this product, else why not (a short phrase)."""
    if triton is None:
        return "triton is not installed"
    if a.dtype not in _TL_DTYPES:
        return f"activations are {a.dtype}, not fp32/fp16/bf16"
    if a.dim() != 2:
        return "activations are not 2-D"
    if a.shape[1] != (w.cols if transpose else w.rows):
        raise ValueError(f"nf4_matmul: A is {tuple(a.shape)}, W is [{w.rows}, {w.cols}] (transpose={transpose})")
    if w.cols % w.blocksize:
        return f"weight rows ({w.cols} values) are not whole {w.blocksize}-value quantization blocks"
    if w.packed.device != a.device:
        return "weight and activations are on different devices"
    return None


def nf4_matmul_triton(
    a: torch.Tensor,
    w: NF4Weight,
    transpose: bool = True,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    config: Optional[tuple] = None,
) -> torch.Tensor:
    """a @ W.T (transpose) or a @ W by the Triton kernel; into `out` (added onto it when
    `accumulate`). The caller has checked `nf4_matmul_supported`. `config` (BLOCK_M, BLOCK_N,
    BLOCK_K, num_warps, num_stages) fixes the tiles; without it the GPU autotunes over
    CANDIDATES and the interpreter uses small tiles."""
    count("nf4_matmul:triton")
    m = a.shape[0]
    n, k = (w.rows, w.cols) if transpose else (w.cols, w.rows)
    if out is None:
        if accumulate:
            raise ValueError("nf4_matmul: accumulate needs out")
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype:
        raise ValueError(f"nf4_matmul: out is {tuple(out.shape)} {out.dtype}, expected {(m, n)} {a.dtype}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    interpret = not a.is_cuda
    args = (a, w.packed, w.code, *w.scale_args(), out, m, n, k, w.cols, a.stride(0), a.stride(1))
    args += (out.stride(0), out.stride(1))
    flags = dict(
        TRANS_W=transpose,
        ACCUMULATE=accumulate,
        BS=w.blocksize,
        BS2=w.blocksize2,
        NESTED=w.nested,
        IEEE=a.dtype == torch.float32,
        BITWISE_BF16=interpret,
        GROUP_M=8,
        enable_fp_fusion=False,  # the decoded W is bit-exact (see nf4_dequant); the dot is unaffected
    )
    if config is None and not interpret:
        tuner = _tuned("t" if transpose else "n", accumulate)

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        tuner[grid](*args, **flags)
        return out
    bm, bn, bk, warps, stages = config or _INTERPRET_CONFIG
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _nf4_mm_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **flags)
    return out


def nf4_matmul_reference(
    a: torch.Tensor,
    w: NF4Weight,
    transpose: bool = True,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """The stock way: dequantize W (a dense copy), then one torch matmul."""
    count("nf4_matmul:torch")
    dense = dequantize_nf4(w, a.dtype)
    b = dense.t() if transpose else dense
    if out is None:
        return torch.mm(a, b)
    return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)


def nf4_matmul(
    a: torch.Tensor,
    w: NF4Weight,
    transpose: bool = True,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """The kernel on CUDA where it applies, the reference elsewhere (callers that must know
    why the kernel did not run ask `nf4_matmul_supported` themselves)."""
    if on_cuda(a, w.packed) and nf4_matmul_supported(w, a, transpose) is None:
        return nf4_matmul_triton(a, w, transpose, out, accumulate)
    return nf4_matmul_reference(a, w, transpose, out, accumulate)
