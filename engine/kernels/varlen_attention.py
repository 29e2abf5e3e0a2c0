"""Causal flash attention over packed documents (varlen): Triton forward + backward, torch reference.

Layout: every document of a packed batch lies back to back in one token stream, q [T, Hq, D],
k/v [T, Hkv, D] (any token/head strides, unit stride on D), `cu_seqlens` int32 [n_docs + 1] on
the device. Attention never crosses a document boundary. Supports GQA (Hq a multiple of Hkv),
a sliding window with Hugging Face's meaning (query i sees key j iff i - W < j <= i, i.e. flash-attn
window_size=(W - 1, 0)), Gemma-2 logit softcapping (s = cap * tanh(scale * q.k / cap)), GPT-OSS
attention sinks (one learned logit per query head that joins every row's softmax and carries no
value) and any scale.

Work is scheduled from *block tables*: int32 [n_blocks, 2] rows of (document, first token) that
cover every document with blocks of one size and nothing else, so no program is spent on padding
and the grid size is a host integer (no device-to-host sync). `engine.fastpath.packed.PackedSeqInfo` builds
them on the host from the lengths it already knows (heaviest blocks first, for load balance);
`device_block_table` builds a sync-free superset on the device when only `cu_seqlens` is at hand.

Forward keeps the softmax statistics (log-sum-exp, base 2) for backward, which runs three kernels:
delta = rowsum(dO * O), then dK/dV per key block (looping over the whole query-head group, so GQA
gradients accumulate in registers with no atomics), then dQ per query block. For packed short
documents it can run two (`fuse_delta`, off by default until checked on a GPU): dQ first, making
delta for its own rows as it goes, then dK/dV reading it. That split backward
is the reference path; engine.kernels.varlen_attention_bwd holds the one-pass backward (dQ, dK, dV
in one kernel, dQ by atomic adds), taken when asked for (`backward=` / TUNESMITH_ATTN_BWD).

The query-block kernels (forward, dQ) may pack the query heads of a GQA group: a program then owns
BLOCK_M positions of PACK heads, a tile of PACK * BLOCK_M rows that reads each K/V block once for
all of them and masks at BLOCK_M's granularity (`_packed_rows`; varlen_attention_configs.PACK_ENV).

Launch configurations come from small fixed candidate lists per head dim, one for packed short
documents and one for long ones (the longest at least LONG_DOCUMENT tokens, a host int the caller
passes as `max_seqlen`); the autotuner ranks a list once per process per (head dim, flags, bucket),
never per shape. The lists, the untuned defaults and the choice between them live in
engine.kernels.varlen_attention_configs; one call's launches (`_Launch`: its shared arguments,
the autotuned or fixed launch of each kernel, a fixed config shrunk to fit a card's shared memory)
in engine.kernels.varlen_attention_launch. TUNESMITH_ATTN_TUNING=old brings back the choices of
before 2026-12-02 so a benchmark can time before and after in one process. Head dims tile up to
512 (Gemma-4's global layers); past 256 the launches take fixed small-tile configs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.counters import count, count_fallback
from engine.kernels.varlen_attention_configs import (
    _ALL_KEY,
    _DKDV_CONFIGS,
    _DKDV_LONG_CONFIGS,
    _DQ_CONFIGS,
    _DQ_LONG_CONFIGS,
    _FWD_CONFIGS,
    _FWD_LONG_CONFIGS,
    _LONG_KEY,
    AUTOTUNED_MAX_HEAD_DIM,
    _tuned,
)

# The launch lists (see varlen_attention_configs). Names imported `as` themselves are re-exported:
# tests and benches read them from this module.
from engine.kernels.varlen_attention_configs import _DEFAULTS as _DEFAULTS
from engine.kernels.varlen_attention_configs import _LONG_DEFAULTS as _LONG_DEFAULTS
from engine.kernels.varlen_attention_configs import FUSED_DELTA_ENV as FUSED_DELTA_ENV
from engine.kernels.varlen_attention_configs import LONG_DOCUMENT as LONG_DOCUMENT
from engine.kernels.varlen_attention_configs import TABLE_BLOCKS as TABLE_BLOCKS
from engine.kernels.varlen_attention_configs import TUNING_ENV as TUNING_ENV
from engine.kernels.varlen_attention_configs import _cfg as _cfg
from engine.kernels.varlen_attention_configs import _fixed as _fixed
from engine.kernels.varlen_attention_configs import _prune as _prune
from engine.kernels.varlen_attention_configs import fuse_delta as fuse_delta
from engine.kernels.varlen_attention_configs import fused_delta_on as fused_delta_on

# One call's shared arguments and each kernel's launch (autotuned or fixed): its own module.
from engine.kernels.varlen_attention_launch import LOG2E as LOG2E
from engine.kernels.varlen_attention_launch import TableFn as TableFn
from engine.kernels.varlen_attention_launch import _Launch as _Launch

# --------------------------------------------------------------------------------------------
# Reference (also the CPU path of the engine)
# --------------------------------------------------------------------------------------------


def _doc_mask(n: int, causal: bool, sliding_window: Optional[int], device) -> Optional[torch.Tensor]:
    if not causal and sliding_window is None:
        return None
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j) < sliding_window
    return keep


def varlen_attention_reference(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen=None,
    *,
    scale=None,
    causal=True,
    sliding_window=None,
    softcap=None,
    dropout_p=0.0,
    sinks=None,
):
    """Per-document attention in plain torch: SDPA where it can, explicit softmax for softcap and
    sinks (`sinks` [Hq]: one logit per query head, in the scores' units, joining every row's softmax
    with no value, as GPT-OSS's eager attention does).

    Reads `cu_seqlens` on the host (a sync on CUDA, counted as "host_syncs" in engine.counters on every
    device): this is the reference and the CPU path.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    bounds = cu_seqlens.tolist()
    count("host_syncs")
    out = q.new_empty(t, hq, v.shape[-1])  # values may be narrower than keys (MLA)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        qd = q[s:e].transpose(0, 1)
        kd = k[s:e].transpose(0, 1).repeat_interleave(group, 0)
        vd = v[s:e].transpose(0, 1).repeat_interleave(group, 0)
        if softcap is None and sinks is None:
            mask = _doc_mask(e - s, causal, sliding_window, q.device)
            od = F.scaled_dot_product_attention(
                qd,
                kd,
                vd,
                attn_mask=mask if sliding_window is not None else None,
                is_causal=causal and sliding_window is None,
                dropout_p=dropout_p,
                scale=scale,
            )
        else:
            scores = (qd.float() @ kd.float().transpose(-1, -2)) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            mask = _doc_mask(e - s, causal, sliding_window, q.device)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:
                sink = sinks.float()[:, None, None].expand(hq, e - s, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            if dropout_p > 0:
                probs = F.dropout(probs, dropout_p)
            od = (probs @ vd.float()).to(q.dtype)
        out[s:e] = od.transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# Block tables
# --------------------------------------------------------------------------------------------


def host_block_table(lengths, block: int, kind: str) -> torch.Tensor:
    """(document, first token) per block of `block` tokens, on the host, heaviest blocks first.

    A query block's cost grows with how far into its document it sits (causal), a key block's
    with how many queries follow it; launching the heavy ones first keeps the GPU's tail short.
    """
    lens = torch.as_tensor(list(lengths), dtype=torch.int64)
    n = lens.numel()
    nb = (lens + block - 1) // block
    total = int(nb.sum())
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    doc = torch.repeat_interleave(torch.arange(n), nb)
    first_blk = torch.cumsum(nb, 0) - nb
    blk = torch.arange(total) - torch.repeat_interleave(first_blk, nb)
    offset = blk * block
    work = offset + block if kind == "q" else lens[doc] - offset
    order = torch.argsort(-work, stable=True)
    table = torch.stack([doc, cu[doc] + offset], dim=1)[order]
    return table.to(torch.int32).contiguous()


def device_block_table(cu_seqlens: torch.Tensor, total_tokens: int, block: int) -> tuple[torch.Tensor, int]:
    """A block table built on the device from `cu_seqlens` alone, with no device-to-host sync.

    The block count is not known on the host, so the table has the host-known upper bound
    cdiv(T, block) + n_docs rows; rows past the real count hold document -1 and exit at once.
    """
    cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    bound = triton.cdiv(max(total_tokens, 1), block) + n
    lens = cu[1:] - cu[:-1]
    nb = (lens + block - 1) // block
    ends = torch.cumsum(nb, 0)
    p = torch.arange(bound, device=cu.device)
    doc = torch.searchsorted(ends, p, right=True)
    valid = doc < n
    docc = doc.clamp(max=max(n - 1, 0))
    start = cu[docc] + (p - (ends[docc] - nb[docc])) * block
    table = torch.stack([torch.where(valid, docc, -1), torch.where(valid, start, 0)], dim=1)
    return table.to(torch.int32).contiguous(), bound


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp2: available in every Triton version and in the interpreter; saturates to
    # +-1 without NaN because 2 / (inf + 1) == 0.
    e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _scores(qk, mul_a, mul_b, HAS_SOFTCAP: tl.constexpr):
    # Scores in base-2 units. Without softcap mul_a = scale * log2e. With softcap
    # mul_a = scale / cap and mul_b = cap * log2e, and t = tanh(.) is returned for the derivative.
    if HAS_SOFTCAP:
        t = _tanh(qk * mul_a)
        return t * mul_b, t
    else:
        return qk * mul_a, qk


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    sk_t,
    sv_t,
    offs_m,
    offs_d,
    lo,
    hi,
    doc_end,
    mul_a,
    mul_b,
    window,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    # Addresses are built once and advanced per step (int64: T * stride may pass 2**31).
    rows0 = (lo + offs_n0).to(tl.int64)
    k_ptrs = k_base + rows0[:, None] * sk_t + offs_d[None, :]
    v_ptrs = v_base + rows0[:, None] * sv_t + offs_d[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASK:
            kv_ok = offs_n < doc_end
            k = tl.load(k_ptrs, mask=kv_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        k_ptrs += BLOCK_N * sk_t
        v_ptrs += BLOCK_N * sv_t
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, _t = _scores(qk, mul_a, mul_b, HAS_SOFTCAP)
        if MASK:
            ok = kv_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            if HAS_WINDOW:
                ok = ok & ((offs_m[:, None] - offs_n[None, :]) < window)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Accumulate inside the MMA (acc operand) rather than with a separate add.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _packed_rows(m0, head0, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """(position, query head) of each row of a query-block program's tile: PACK heads of BLOCK_M
    positions, head-major. Every mask reads only positions, so a packed tile masks as an unpacked one."""
    r = tl.arange(0, PACK * BLOCK_M)
    if PACK == 1:
        return m0 + r, head0 + tl.zeros([BLOCK_M], dtype=tl.int32)
    return m0 + r % BLOCK_M, head0 + r // BLOCK_M


@triton.jit
def _key_range(
    m0,
    doc_start,
    doc_end,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Keys a block of queries [m0, m0 + BLOCK_M) must visit: [lo, hi), of which [lo, mid) needs no
    # mask (every key is before every query and inside the document); [mid, hi) is masked.
    if CAUSAL:
        hi = tl.minimum(doc_end, m0 + BLOCK_M)
    else:
        hi = doc_end
    if HAS_WINDOW:
        lo = tl.maximum(doc_start, m0 - window + 1)
        mid = lo
    else:
        lo = doc_start
        if CAUSAL:
            mid = lo + ((m0 - lo) // BLOCK_N) * BLOCK_N
        else:
            mid = lo + ((doc_end - lo) // BLOCK_N) * BLOCK_N
    return lo, mid, hi


@triton.jit
def _query_range(
    n0,
    doc_start,
    doc_end,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Queries a block of keys [n0, n0 + BLOCK_N) must visit: [q_lo, q_hi), walked in BLOCK_M steps
    # as [q_lo, diag_end) masked, [diag_end, full_end) unmasked, [full_end, q_hi) masked. Causal
    # without window: the diagonal steps (each sees key n0, so none is wholly masked), then whole
    # unmasked steps, then the document's ragged end. Queries before n0 see none of these keys and
    # are never visited (tests/kernels/test_varlen_attention_long.py checks every tile).
    if CAUSAL:
        q_lo = n0
    else:
        q_lo = doc_start
    if HAS_WINDOW:
        q_hi = tl.minimum(doc_end, n0 + BLOCK_N - 1 + window)
    else:
        q_hi = doc_end
    if CAUSAL and not HAS_WINDOW:
        # Whole query steps: BLOCK_N need not be a multiple of BLOCK_M.
        diag_end = tl.minimum(n0 + ((BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, q_hi)
        full_end = diag_end + tl.maximum(q_hi - diag_end, 0) // BLOCK_M * BLOCK_M
    else:
        diag_end = q_hi
        full_end = q_hi
    return q_lo, diag_end, full_end, q_hi


@triton.jit(do_not_specialize=["long_docs"])
def _attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    SINKS,
    CU,
    TBL_A,
    TBL_B,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    so_t,
    so_h,
    s_lse,
    mul_a,
    mul_b,
    window,
    long_docs,  # unused in the body: the autotuner's key (see LONG_DOCUMENT)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
):
    # A program owns BLOCK_M positions of PACK query heads of one GQA group (PACK * BLOCK_M rows,
    # head-major): each K/V block it reads serves all of them (varlen_attention_configs.PACK_ENV).
    head0 = tl.program_id(0) * PACK
    pid = tl.program_id(1)
    # Autotuning may pick either block size; the launcher passes a table for each.
    if BLOCK_M == BLOCK_A:
        tbl = TBL_A
    else:
        tbl = TBL_B
    doc = tl.load(tbl + 2 * pid)
    if doc < 0:
        return
    m0 = tl.load(tbl + 2 * pid + 1)
    doc_start = tl.load(CU + doc)
    doc_end = tl.load(CU + doc + 1)
    kvh = head0 // GROUP

    offs_m, heads = _packed_rows(m0, head0, BLOCK_M, PACK)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < doc_end
    rows = offs_m.to(tl.int64)
    q = tl.load(Q + heads[:, None] * sq_h + rows[:, None] * sq_t + offs_d[None, :], mask=m_ok[:, None], other=0.0)

    if HAS_SINKS:
        # The head's sink is one more logit in every row's softmax, with no value: it starts the
        # running max and sum (exp2(sink - sink) = 1), so the log-sum-exp kept for the backward
        # counts it and the backward's probabilities come out right with no change there.
        sink = tl.load(SINKS + heads).to(tl.float32) * 1.4426950408889634  # base 2, as the scores
        m_i = tl.zeros([PACK * BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([PACK * BLOCK_M], 1.0, dtype=tl.float32)
    else:
        # A finite floor instead of -inf keeps rows whose first visited keys are all masked
        # (sliding window) free of inf - inf = NaN.
        m_i = tl.full([PACK * BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([PACK * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([PACK * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = K + kvh * sk_h
    v_base = V + kvh * sv_h
    lo, mid, hi = _key_range(m0, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        sk_t,
        sv_t,
        offs_m,
        offs_d,
        lo,
        mid,
        doc_end,
        mul_a,
        mul_b,
        window,
        BLOCK_N,
        False,
        CAUSAL,
        HAS_WINDOW,
        HAS_SOFTCAP,
        DOT_PREC,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        sk_t,
        sv_t,
        offs_m,
        offs_d,
        mid,
        hi,
        doc_end,
        mul_a,
        mul_b,
        window,
        BLOCK_N,
        True,
        CAUSAL,
        HAS_WINDOW,
        HAS_SOFTCAP,
        DOT_PREC,
    )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        O + heads[:, None] * so_h + rows[:, None] * so_t + offs_d[None, :], o.to(O.dtype.element_ty), mask=m_ok[:, None]
    )
    tl.store(LSE + heads * s_lse + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


@triton.jit
def _bwd_delta(O, DO, DELTA, T, so_t, so_h, sdo_t, sdo_h, s_delta, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    head = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_t < T
    rows = offs_t.to(tl.int64)
    o = tl.load(O + head * so_h + rows[:, None] * so_t + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + head * sdo_h + rows[:, None] * sdo_t + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + head * s_delta + offs_t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    sq_t,
    sdo_t,
    offs_n,
    offs_d,
    lo,
    hi,
    doc_end,
    mul_a,
    mul_b,
    window,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    REBUILD_ADDR: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M)
    if not REBUILD_ADDR:  # the form before 2026-12-02, kept for TUNESMITH_ATTN_TUNING=old
        rows0 = (lo + offs_m0).to(tl.int64)
        q_ptrs = q_base + rows0[:, None] * sq_t + offs_d[None, :]
        do_ptrs = do_base + rows0[:, None] * sdo_t + offs_d[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if REBUILD_ADDR:
            # Addresses rebuilt per step instead of carried through the loop: two [BLOCK_M, D] tiles
            # of 64-bit pointers live across iterations cost the registers that the dK/dV
            # accumulators and the K/V tiles need (ptxas, sm_90a: the carried form spills at every
            # head_dim-128 config; see LONG_DOCUMENT's tables). The addresses are the same.
            rows = offs_m.to(tl.int64)
            q_ptrs = q_base + rows[:, None] * sq_t + offs_d[None, :]
            do_ptrs = do_base + rows[:, None] * sdo_t + offs_d[None, :]
        if MASK:
            m_ok = offs_m < doc_end
            q = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        if not REBUILD_ADDR:
            q_ptrs += BLOCK_M * sq_t
            do_ptrs += BLOCK_M * sdo_t
        # Transposed tiles ([keys, queries]) so dK/dV accumulate without transposing big tiles.
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        sT, tT = _scores(qkT, mul_a, mul_b, HAS_SOFTCAP)
        pT = tl.exp2(sT - lse[None, :])
        if MASK:
            ok = m_ok[None, :] & (offs_n[:, None] < doc_end)
            if CAUSAL:
                ok = ok & (offs_n[:, None] <= offs_m[None, :])
            if HAS_WINDOW:
                ok = ok & ((offs_m[None, :] - offs_n[:, None]) < window)
            pT = tl.where(ok, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


# long_docs is not specialised: 0 and 1 would otherwise compile two copies of every config.
@triton.jit(do_not_specialize=["long_docs"])
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    CU,
    TBL_A,
    TBL_B,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sdo_t,
    sdo_h,
    sdk_t,
    sdk_h,
    sdv_t,
    sdv_h,
    s_lse,
    sm_scale,
    mul_a,
    mul_b,
    window,
    long_docs,  # unused in the body: the autotuner's key (see LONG_DOCUMENT)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    REBUILD_ADDR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kvh = tl.program_id(0)
    pid = tl.program_id(1)
    if BLOCK_N == BLOCK_A:
        tbl = TBL_A
    else:
        tbl = TBL_B
    doc = tl.load(tbl + 2 * pid)
    if doc < 0:
        return
    n0 = tl.load(tbl + 2 * pid + 1)
    doc_start = tl.load(CU + doc)
    doc_end = tl.load(CU + doc + 1)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < doc_end
    rows = offs_n.to(tl.int64)
    k = tl.load(K + kvh * sk_h + rows[:, None] * sk_t + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(V + kvh * sv_h + rows[:, None] * sv_t + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    q_lo, diag_end, full_end, q_hi = _query_range(n0, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for g in range(GROUP):
        head = kvh * GROUP + g
        q_base = Q + head * sq_h
        do_base = DO + head * sdo_h
        lse_base = LSE + head * s_lse
        delta_base = DELTA + head * s_lse
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            offs_n,
            offs_d,
            q_lo,
            diag_end,
            doc_end,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
            REBUILD_ADDR,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            offs_n,
            offs_d,
            diag_end,
            full_end,
            doc_end,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            False,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
            REBUILD_ADDR,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            offs_n,
            offs_d,
            full_end,
            q_hi,
            doc_end,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
            REBUILD_ADDR,
        )
    dk = dk * sm_scale
    tl.store(DK + kvh * sdk_h + rows[:, None] * sdk_t + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DV + kvh * sdv_h + rows[:, None] * sdv_t + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    sk_t,
    sv_t,
    offs_m,
    offs_d,
    lo,
    hi,
    doc_end,
    mul_a,
    mul_b,
    window,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    rows0 = (lo + offs_n0).to(tl.int64)
    k_ptrs = k_base + rows0[:, None] * sk_t + offs_d[None, :]
    v_ptrs = v_base + rows0[:, None] * sv_t + offs_d[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASK:
            kv_ok = offs_n < doc_end
            k = tl.load(k_ptrs, mask=kv_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        k_ptrs += BLOCK_N * sk_t
        v_ptrs += BLOCK_N * sv_t
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, t = _scores(qk, mul_a, mul_b, HAS_SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASK:
            ok = kv_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            if HAS_WINDOW:
                ok = ok & ((offs_m[:, None] - offs_n[None, :]) < window)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["long_docs"])
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    O,
    CU,
    TBL_A,
    TBL_B,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sdo_t,
    sdo_h,
    sdq_t,
    sdq_h,
    so_t,
    so_h,
    s_lse,
    sm_scale,
    mul_a,
    mul_b,
    window,
    long_docs,  # unused in the body: the autotuner's key (see LONG_DOCUMENT)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FUSED_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
):
    # Programs own BLOCK_M positions of PACK heads, as in the forward. FUSED_DELTA: this kernel
    # runs first and makes delta = rowsum(dO * O) for its own rows (O may share DQ's memory: each
    # program reads its rows of O before it writes their dQ) and stores it for dK/dV, which runs
    # after it; else delta comes from _bwd_delta.
    head0 = tl.program_id(0) * PACK
    pid = tl.program_id(1)
    if BLOCK_M == BLOCK_A:
        tbl = TBL_A
    else:
        tbl = TBL_B
    doc = tl.load(tbl + 2 * pid)
    if doc < 0:
        return
    m0 = tl.load(tbl + 2 * pid + 1)
    doc_start = tl.load(CU + doc)
    doc_end = tl.load(CU + doc + 1)
    kvh = head0 // GROUP

    offs_m, heads = _packed_rows(m0, head0, BLOCK_M, PACK)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < doc_end
    rows = offs_m.to(tl.int64)
    q = tl.load(Q + heads[:, None] * sq_h + rows[:, None] * sq_t + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + heads[:, None] * sdo_h + rows[:, None] * sdo_t + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    lse = tl.load(LSE + heads * s_lse + offs_m, mask=m_ok, other=0.0)
    if FUSED_DELTA:
        o = tl.load(O + heads[:, None] * so_h + rows[:, None] * so_t + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + heads * s_lse + offs_m, delta, mask=m_ok)
    else:
        delta = tl.load(DELTA + heads * s_lse + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([PACK * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = K + kvh * sk_h
    v_base = V + kvh * sv_h
    lo, mid, hi = _key_range(m0, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    dq = _dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_base,
        v_base,
        sk_t,
        sv_t,
        offs_m,
        offs_d,
        lo,
        mid,
        doc_end,
        mul_a,
        mul_b,
        window,
        BLOCK_N,
        False,
        CAUSAL,
        HAS_WINDOW,
        HAS_SOFTCAP,
        DOT_PREC,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_base,
        v_base,
        sk_t,
        sv_t,
        offs_m,
        offs_d,
        mid,
        hi,
        doc_end,
        mul_a,
        mul_b,
        window,
        BLOCK_N,
        True,
        CAUSAL,
        HAS_WINDOW,
        HAS_SOFTCAP,
        DOT_PREC,
    )
    dq = dq * sm_scale
    tl.store(
        DQ + heads[:, None] * sdq_h + rows[:, None] * sdq_t + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=m_ok[:, None],
    )


# --------------------------------------------------------------------------------------------
# Autotuned kernels (their launch lists: engine.kernels.varlen_attention_configs)
# --------------------------------------------------------------------------------------------

_attn_fwd_tuned = _tuned(_attn_fwd, _FWD_CONFIGS, key=_LONG_KEY, long_table=_FWD_LONG_CONFIGS)
_attn_bwd_dkdv_tuned = _tuned(
    _attn_bwd_dkdv, _DKDV_CONFIGS, key=_LONG_KEY + ["REBUILD_ADDR"], long_table=_DKDV_LONG_CONFIGS
)
_attn_bwd_dq_tuned = _tuned(_attn_bwd_dq, _DQ_CONFIGS, key=_LONG_KEY, long_table=_DQ_LONG_CONFIGS)
# dQ making delta itself (short documents only, see fuse_delta). O is put back after every timed
# candidate: a candidate that wrote dQ over O would hand the next one dQ as O.
_attn_bwd_dq_delta_tuned = _tuned(_attn_bwd_dq, _DQ_CONFIGS, key=_ALL_KEY, restore_value=["O"])


def tuned_kernels() -> dict:
    """{kernel: its autotuner} for every attention kernel that autotunes (the one-pass backward's too)."""
    from engine.kernels.varlen_attention_bwd import _attn_bwd_onepass_tuned

    return {
        "fwd": _attn_fwd_tuned,
        "dkdv": _attn_bwd_dkdv_tuned,
        "dq": _attn_bwd_dq_tuned,
        "dq_delta": _attn_bwd_dq_delta_tuned,
        "onepass": _attn_bwd_onepass_tuned,
    }


def forget_tuning() -> None:
    """Clear the attention autotuners' picks, so the next call ranks its candidates again: for a
    benchmark that changes TUNESMITH_ATTN_PACK or TUNESMITH_ATTN_TUNING between variants in one
    process (the autotuner's key holds neither)."""
    for kernel in tuned_kernels().values():
        getattr(kernel, "cache", {}).clear()
        kernel.best_config = None


def _forward(q, k, v, L: _Launch, sinks: Optional[torch.Tensor] = None):
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((L.hq, max(L.t, 1)), dtype=torch.float32, device=q.device)
    if L.t == 0:
        return o, lse
    tail = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        lse.stride(0),
        L.mul_a,
        L.mul_b,
        L.window,
        L.long_docs,
    )
    # Without sinks the SINKS pointer is never read; lse stands in for it.
    head_args = (q, k, v, o, lse, sinks if sinks is not None else lse, L.cu)
    L.run("fwd", _attn_fwd_tuned, _attn_fwd, L.hq, head_args, tail, extra=dict(HAS_SINKS=sinks is not None))
    return o, lse


def _sink_grad(do, o, lse, sinks, L: _Launch) -> torch.Tensor:
    """d loss / d sinks [Hq]. A sink is a softmax logit with no value, so its gradient is
    -sum over tokens of p_sink * rowsum(dO * O), p_sink = exp2(sink * log2e - lse). Tokens past the
    last document (outputs unspecified) are left out; no host sync."""
    t = L.t
    delta = (o.float() * do.float()).sum(-1)  # [T, Hq]
    p = torch.exp2(sinks.float()[None, :] * LOG2E - lse[:, :t].t())
    covered = (torch.arange(t, device=o.device) < L.cu[-1])[:, None]
    return -torch.where(covered, p * delta, 0.0).sum(0).to(sinks.dtype)


def backward_delta(o, do, lse, L: _Launch) -> torch.Tensor:
    """delta = rowsum(dO * O) [Hq, T] (lse's layout), by the _bwd_delta kernel."""
    delta = torch.empty_like(lse)
    block = 64 if L.d <= AUTOTUNED_MAX_HEAD_DIM else 16  # [block, D] of O and dO per program
    _bwd_delta[(L.hq, triton.cdiv(L.t, block))](
        o,
        do,
        delta,
        L.t,
        o.stride(0),
        o.stride(1),
        do.stride(0),
        do.stride(1),
        delta.stride(0),
        HEAD_DIM=L.d,
        BLOCK=block,
    )
    return delta


def _backward(do, q, k, v, o, lse, L: _Launch, o_private: bool = False):
    # o_private: O belongs to this backward alone (an offloader's recompute made it, or took it back
    # from the layer's KeptAttention: no caller holds it). Then dQ goes into O's memory: after the delta kernel (the
    # first launch below, in stream order) nothing reads O, and on a long row one activation less
    # is live at the layer backward's highest point (W7). O's version is bumped, so a second
    # backward through a retained graph stops with torch's "modified by an inplace operation"
    # instead of reading dQ as O.
    reuse_o = o_private and o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    dq = o if reuse_o else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if L.t == 0:
        return dq, dk.zero_(), dv.zero_()
    fused = fuse_delta(L.longest)
    delta = torch.empty_like(lse) if fused else backward_delta(o, do, lse, L)
    if not L.covers_all:
        # Tokens no document covers get no dK/dV program; zero them (skipped when the caller
        # knows cu_seqlens spans the whole stream, which saves two memsets per layer).
        dk.zero_()
        dv.zero_()
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1))
    dkdv_rest = common + (
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        lse.stride(0),
        L.scale,
        L.mul_a,
        L.mul_b,
        L.window,
        L.long_docs,
    )
    dkdv_args = (q, k, v, do, dk, dv, lse, delta, L.cu)
    dq_args = (q, k, v, do, dq, lse, delta, o, L.cu)
    dq_rest = common + (dq.stride(0), dq.stride(1), o.stride(0), o.stride(1), lse.stride(0))
    dq_rest += (L.scale, L.mul_a, L.mul_b, L.window, L.long_docs)
    if fused:  # dQ first: it makes the delta dK/dV reads
        dq_tuned = _attn_bwd_dq_delta_tuned
        L.run("dq", dq_tuned, _attn_bwd_dq, L.hq, dq_args, dq_rest, extra=dict(FUSED_DELTA=True))
    extra = dict(REBUILD_ADDR=L.rebuild_addr)
    L.run("dkdv", _attn_bwd_dkdv_tuned, _attn_bwd_dkdv, L.hkv, dkdv_args, dkdv_rest, extra=extra)
    if not fused:
        L.run("dq", _attn_bwd_dq_tuned, _attn_bwd_dq, L.hq, dq_args, dq_rest, extra=dict(FUSED_DELTA=False))
    if reuse_o:
        torch.autograd.graph.increment_version(o)
    return dq, dk, dv


@dataclass
class KeptAttention:
    """Attention outputs kept across a checkpointed layer's recompute, owned by the offloader
    (engine.fastpath.offload: one per decoder layer) and handed down to the attention call
    with the layer's kwargs (KEPT_KWARG).

    mode "keep" (the layer's first forward): each attention call appends its (o, lse) to
    `outputs`; mode "reuse" (the recompute): the calls take them back in call order instead of
    running the forward kernel again. The recompute's q/k/v are bitwise those of the first
    forward (same inputs, same kernels), so the backward is the one it would have been. Costs
    the kept outputs' memory; pays when attention is long. Mode "recompute" (a recompute with
    nothing kept): the calls compute as usual, and their outputs belong to the backward alone.
    In both recompute modes the backward writes dQ into the output's memory.
    """

    mode: Optional[str] = None  # None, "keep", "reuse" or "recompute"
    outputs: list = field(default_factory=list)


# The kwarg that carries a layer's KeptAttention from the offloader to the attention function.
KEPT_KWARG = "tunesmith_kept_attention"


def _forward_or_kept(q, k, v, launch: _Launch, kept: Optional[KeptAttention] = None, sinks=None):
    mode = kept.mode if kept is not None else None
    if mode == "reuse" and kept.outputs:
        o, lse = kept.outputs.pop(0)
        if o.shape == q.shape and o.dtype == q.dtype and o.device == q.device:
            return o, lse
        kept.outputs.clear()  # not this call's output: the layer changed; compute as usual
    o, lse = _forward(q, k, v, launch, sinks)
    if mode == "keep":
        kept.outputs.append((o, lse))
    return o, lse


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, launch: _Launch, kept: Optional[KeptAttention] = None):
        # The output is this backward's alone when an offloader's recompute makes it or hands a kept one back.
        ctx.o_private = kept is not None and (kept.mode == "recompute" or (kept.mode == "reuse" and bool(kept.outputs)))
        o, lse = _forward_or_kept(q, k, v, launch, kept, sinks)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.launch = launch
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        # dQ, dK and dV need nothing new for sinks: the kept log-sum-exp already counts them.
        dsinks = _sink_grad(do, o, lse, sinks, ctx.launch) if ctx.needs_input_grad[3] else None
        if ctx.launch.backward == "onepass":
            from engine.kernels import varlen_attention_bwd  # it builds on this module's kernels

            if varlen_attention_bwd.onepass_allowed():
                dq, dk, dv = varlen_attention_bwd.onepass_backward(do, q, k, v, o, lse, ctx.launch)
                return dq, dk, dv, dsinks, None, None
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.launch, o_private=ctx.o_private)
        return dq, dk, dv, dsinks, None, None


def _check(q, k, v, cu_seqlens):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q/k/v shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q/k/v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError("cu_seqlens must be int32 on the same device as q")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on head_dim")


def varlen_attention_triton(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen=None,
    *,
    scale=None,
    causal=True,
    sliding_window=None,
    softcap=None,
    tables: Optional[TableFn] = None,
    blocks: Optional[tuple[int, int]] = None,
    covers_all_tokens: bool = False,
    kept: Optional[KeptAttention] = None,
    backward: Optional[str] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """Triton varlen attention (differentiable). `tables` supplies block tables (see module
    doc); without it they are built on the device from `cu_seqlens` (sync-free, a few tiny
    launches per call). `blocks` pins (table block, step block) for every kernel (tests).
    `covers_all_tokens`: the caller knows cu_seqlens[-1] == T (skips zeroing dK/dV); otherwise
    outputs of tokens outside every document are unspecified and their dK/dV are zero.
    `max_seqlen` (a host int, else ignored) only chooses the backward; the block tables size the grids.
    `kept`: a layer's KeptAttention while the offloader keeps attention outputs (else None).
    `backward`: "split" (dK/dV then dQ, the reference path), "onepass" (engine.kernels.varlen_attention_bwd)
    or "auto" (one-pass when `max_seqlen`, a host int, reaches its LONG_DOCUMENT and its fp32 dQ
    buffer fits DQ_BUFFER_BYTES); None reads the environment variable TUNESMITH_ATTN_BWD (default "auto").
    `sinks`: [Hq] attention-sink logits on q's device (GPT-OSS), differentiable, or None."""
    _check(q, k, v, cu_seqlens)
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"sinks must be [{q.shape[1]}] (one per query head) on q's device, got {tuple(sinks.shape)}")
    from engine.kernels.varlen_attention_bwd import resolve_backward

    longest = max_seqlen if isinstance(max_seqlen, int) else None
    bwd = resolve_backward(backward, longest, q.shape[0] * q.shape[1] * q.shape[2] * 4)
    if bwd == "onepass" and q.shape[2] > AUTOTUNED_MAX_HEAD_DIM:
        widest = AUTOTUNED_MAX_HEAD_DIM
        count_fallback("attention_backward", f"head dim {q.shape[2]}: the one-pass backward tiles up to {widest}")
        bwd = "split"
    if tables is None:
        t = q.shape[0]
        cache: dict = {}

        def tables(kind, block):  # noqa: F811 - both kinds share one device table per block
            if block not in cache:
                cache[block] = device_block_table(cu_seqlens, t, block)
            return cache[block]

    launch = _Launch(
        q, k, cu_seqlens, tables, scale, causal, sliding_window, softcap, blocks, covers_all_tokens, longest, bwd
    )
    return _VarlenAttention.apply(q, k, v, sinks, launch, kept)
