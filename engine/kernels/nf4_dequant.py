"""NF4 dequantization of a bitsandbytes 4-bit weight (double quantization included), in Triton.

bitsandbytes' layout (read from its `dequantize_4bit` / `quantize_4bit`):

- the weight [rows, cols] is flattened row-major and packed two 4-bit codes per byte, the
  element with the even flat index in the HIGH nibble: byte i holds elements 2i (b >> 4) and
  2i + 1 (b & 15);
- a code indexes the 16-entry NF4 table (`quant_state.code`, fp32);
- every `blocksize` (64 for weights) consecutive flat elements share one scale, absmax;
- with double quantization (`quant_state.nested`) absmax is itself stored as uint8 codes into
  a 256-entry table (`state2.code`) scaled per `state2.blocksize` (256) absmax values by
  `state2.absmax` (fp32), plus one fp32 `offset`:
  ``absmax[b] = code2[q[b]] * absmax2[b // 256] + offset``;
- the value is ``code[nibble] * absmax[block]`` in fp32, rounded once to the output dtype.

The kernel repeats those fp32 operations in the same order (a multiply, then an add, then a
multiply), so its output is bit-identical to `dequantize_4bit`. That is why it is launched with
FMA contraction off: a fused ``code2 * absmax2 + offset`` rounds once instead of twice.

Public: `NF4Weight` (the pieces of a quantized weight the kernels read, views only),
`dequantize_nf4` (dispatcher: Triton on CUDA, the reference elsewhere), `dequantize_nf4_triton`,
`dequantize_nf4_reference` (plain torch). The Triton helpers `block_scale` and `nf4_tile` are
shared with engine.kernels.nf4_matmul, which decodes tiles of the weight inside its matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.counters import count
from engine.kernels._common import jit, on_cuda, tl

_BLOCK_BYTES = 1024  # packed bytes per program (2,048 values)


@dataclass(frozen=True)
class NF4Weight:
    """A bitsandbytes NF4 weight as the kernels read it: tensors are the quant state's own.

    absmax is uint8 codes when `nested` (then absmax2, code2 and offset are set), else fp32.
    """

    packed: torch.Tensor  # uint8, (rows * cols + 1) // 2 bytes, high nibble first
    absmax: torch.Tensor
    code: torch.Tensor  # fp32 [16], the NF4 table
    rows: int
    cols: int
    blocksize: int
    dtype: torch.dtype  # what dequantize_4bit returns
    nested: bool
    absmax2: Optional[torch.Tensor] = None  # fp32, one per blocksize2 absmax codes
    code2: Optional[torch.Tensor] = None  # fp32 [256]
    offset: Optional[torch.Tensor] = None  # fp32 scalar tensor (read on the device, never on the host)
    blocksize2: int = 256

    @classmethod
    def from_bnb(cls, packed: torch.Tensor, state) -> "NF4Weight":
        """From bitsandbytes' packed tensor and QuantState (quant_type must be "nf4")."""
        if state.quant_type != "nf4":
            raise ValueError(f"NF4Weight needs quant_type 'nf4', got {state.quant_type!r}")
        if len(state.shape) != 2:
            raise ValueError(f"NF4Weight needs a 2-D weight, got shape {tuple(state.shape)}")
        rows, cols = (int(d) for d in state.shape)
        flat = packed.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        kw = {}
        if state.nested:
            s2 = state.state2
            kw = dict(absmax2=s2.absmax, code2=s2.code, offset=state.offset, blocksize2=int(s2.blocksize))
        return cls(
            flat, state.absmax, state.code, rows, cols, int(state.blocksize), state.dtype, bool(state.nested), **kw
        )

    def scale_args(self) -> tuple:
        """(ABSMAX, ABSMAX2, CODE2, OFFSET) kernel arguments; placeholders where not nested."""
        if self.nested:
            return self.absmax, self.absmax2, self.code2, self.offset
        return self.absmax, self.absmax, self.absmax, self.absmax


# -- Triton helpers shared with the matmul ------------------------------------------------------


@jit
def round_to(x, DTYPE: tl.constexpr, BITWISE_BF16: tl.constexpr):
    """fp32 `x` rounded to nearest-even in DTYPE, as CUDA's conversions and torch's `.to` do.

    BITWISE_BF16 rounds to bf16 with integer ops: Triton's interpreter truncates an fp32 -> bf16
    cast (and its "rtne" rounds ties up), so on a CPU only this form matches bitsandbytes. The
    values decoded here are finite, which is all the trick assumes.
    """
    if DTYPE == tl.bfloat16 and BITWISE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@jit
def block_scale(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, mask, NESTED: tl.constexpr, BS2: tl.constexpr):
    """fp32 absmax of quantization blocks `blk` (any shape), double quantization decoded."""
    if NESTED:
        q = tl.load(ABSMAX + blk, mask=mask, other=0).to(tl.int32)
        s = tl.load(CODE2 + q, mask=mask, other=0.0) * tl.load(ABSMAX2 + blk // BS2, mask=mask, other=0.0)
        s = s + tl.load(OFFSET)
    else:
        s = tl.load(ABSMAX + blk, mask=mask, other=0.0)
    return s


@jit
def nf4_tile(
    P,
    CODE,
    ABSMAX,
    ABSMAX2,
    CODE2,
    OFFSET,
    rows,
    row_mask,
    col0,
    W_COLS,
    BC: tl.constexpr,
    BS: tl.constexpr,
    BS2: tl.constexpr,
    NESTED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BITWISE_BF16: tl.constexpr,
):
    """Weight tile W[rows, col0 : col0 + BC] in OUT_DTYPE, decoded exactly as dequantize_4bit.

    Needs W_COLS % BS == 0 and col0 % BC == 0 (the callers check), so every row of the tile
    lies in whole quantization blocks: one scale per row and SUB-wide column group. Both BC and
    BS are powers of two, so one divides the other.
    """
    SUB: tl.constexpr = BC if BC < BS else BS
    NB: tl.constexpr = BC // SUB
    half = tl.arange(0, BC // 2)
    byte = rows[:, None].to(tl.int64) * (W_COLS // 2) + (col0 // 2) + half[None, :]
    # Columns past the row's end (the last tile of a width that BC does not divide) read 0.
    b = tl.load(P + byte, mask=row_mask[:, None] & (col0 + 2 * half < W_COLS)[None, :], other=0).to(tl.int32)
    hi = tl.load(CODE + (b >> 4))
    lo = tl.load(CODE + (b & 15))
    v = tl.interleave(hi, lo)  # [R, BC]: element 2i from the high nibble, 2i + 1 from the low
    if NB == 1:
        blk = (rows.to(tl.int64) * W_COLS + col0) // BS
        s = block_scale(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, row_mask, NESTED, BS2)
        w = v * s[:, None]
    else:
        sub = tl.arange(0, NB)
        blk = (rows[:, None].to(tl.int64) * W_COLS + col0 + sub[None, :] * SUB) // BS
        sub_mask = row_mask[:, None] & (col0 + sub * SUB < W_COLS)[None, :]
        s = block_scale(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, sub_mask, NESTED, BS2)
        w = tl.reshape(tl.reshape(v, (v.shape[0], NB, SUB)) * s[:, :, None], (v.shape[0], BC))
    return round_to(w, OUT_DTYPE, BITWISE_BF16)


@jit
def _dequant_kernel(
    P,
    CODE,
    ABSMAX,
    ABSMAX2,
    CODE2,
    OFFSET,
    OUT,
    n,
    BS: tl.constexpr,
    BS2: tl.constexpr,
    NESTED: tl.constexpr,
    BITWISE_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)  # byte index
    e = 2 * i  # flat index of its high-nibble element
    m_hi = e < n
    m_lo = e + 1 < n
    b = tl.load(P + i, mask=m_hi, other=0).to(tl.int32)
    # Both elements of a byte share a block (blocksize is even).
    s = block_scale(ABSMAX, ABSMAX2, CODE2, OFFSET, e // BS, m_hi, NESTED, BS2)
    out_ty = OUT.dtype.element_ty
    tl.store(OUT + e, round_to(tl.load(CODE + (b >> 4)) * s, out_ty, BITWISE_BF16), mask=m_hi)
    tl.store(OUT + e + 1, round_to(tl.load(CODE + (b & 15)) * s, out_ty, BITWISE_BF16), mask=m_lo)


# -- entry points --------------------------------------------------------------------------------


def dequantize_nf4_triton(w: NF4Weight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dense [rows, cols] weight in `dtype` (default w.dtype) by the Triton kernel."""
    import triton

    dtype = dtype or w.dtype
    count("nf4_dequant:triton")
    n = w.rows * w.cols
    out = torch.empty((w.rows, w.cols), dtype=dtype, device=w.packed.device)
    if n:
        grid = (triton.cdiv((n + 1) // 2, _BLOCK_BYTES),)
        _dequant_kernel[grid](
            w.packed,
            w.code,
            *w.scale_args(),
            out,
            n,
            BS=w.blocksize,
            BS2=w.blocksize2,
            NESTED=w.nested,
            BITWISE_BF16=not out.is_cuda,
            BLOCK=_BLOCK_BYTES,
            num_warps=4,
            enable_fp_fusion=False,  # bit-exact: code2 * absmax2 rounded before + offset
        )
    return out


def dequantize_nf4_reference(w: NF4Weight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The same decoding in plain torch (fp32 products, one rounding to `dtype`)."""
    dtype = dtype or w.dtype
    n = w.rows * w.cols
    count("nf4_dequant:torch")
    b = w.packed.to(torch.int64)
    codes = torch.stack((b >> 4, b & 15), dim=1).reshape(-1)[:n]
    if w.nested:
        absmax = w.code2[w.absmax.to(torch.int64)]
        blocks2 = torch.arange(absmax.numel(), device=absmax.device) // w.blocksize2
        absmax = absmax * w.absmax2[blocks2] + w.offset
    else:
        absmax = w.absmax.float()
    scale = absmax[torch.arange(n, device=b.device) // w.blocksize]
    return (w.code[codes] * scale).to(dtype).reshape(w.rows, w.cols)


def dequantize_nf4(w: NF4Weight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dense weight: the Triton kernel on CUDA, the torch reference elsewhere."""
    if on_cuda(w.packed):
        return dequantize_nf4_triton(w, dtype)
    return dequantize_nf4_reference(w, dtype)
