"""One-pass backward of the varlen attention kernel: dQ, dK and dV in one Triton kernel.

The split backward of engine.kernels.varlen_attention runs two kernels after delta = rowsum(dO * O):
dK/dV per key block, then dQ per query block. Each recomputes the scores Q.K^T and dP = dO.V^T, so a
causal attention's backward costs 7 block matmuls per (query block, key block) pair and reads Q, dO
once per key block and K, V once per query block. Here one program per key block (and key/value head)
walks the query blocks that see it, for every query head of its GQA group, keeps dK/dV in registers
and adds each step's dQ = dS.K into an fp32 buffer with atomic adds: 5 matmuls per pair, K and V read
once. The price is the atomics (one [BLOCK_M, D] fp32 add per step) and the fp32 dQ buffer; on a long
document (W6: one 32k-token document) the saved matmuls were expected to dominate, but on the H200
the atomics cost more (see AUTO_ONEPASS): `auto` runs the split backward, and the one-pass path is
asked for by name. With AUTO_ONEPASS on, `auto` would take it from LONG_DOCUMENT tokens on while the
whole call's fp32 dQ buffer fits DQ_BUFFER_BYTES (a memory-capped very long sequence, W7, keeps the
split backward, which needs no buffer).

Which backward runs: `varlen_attention_triton(backward=...)`, else the environment variable
TUNESMITH_ATTN_BWD ("auto", "split", "onepass"; default "auto"). The split backward stays the
reference path. fp32 atomic adds make dQ's rounding order vary from run to run, so with
torch.use_deterministic_algorithms(True) the split backward runs instead (a counted fallback,
"fallback:attention_backward: ...").

Every feature of the forward is supported (causal or not, GQA, sliding window, softcap, any scale,
any token/head strides). When asked for explicitly, the fp32 dQ buffer is still bounded: key/value
heads are processed in chunks so it stays under DQ_BUFFER_BYTES (W7's 196k tokens x 32 heads x 128
would otherwise need 3.2 GB).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from engine.counters import count_fallback
from engine.kernels.varlen_attention import _Launch, _query_range, _scores, backward_delta
from engine.kernels.varlen_attention_configs import _ALL_KEY, LONG_DOCUMENT, _cfg, _tuned

BACKWARD_ENV = "TUNESMITH_ATTN_BWD"
BACKWARDS = ("auto", "split", "onepass")
# Whether "auto" ever takes the one-pass backward. Off: on the H200 (2026-12-02, 1a64142,
# bench.attention_micro) it was slower than the split backward at every measured shape: W6 (one
# 32k document, 32/8 heads x 64) 43.8 against 32.9 ms, W1 (16k tokens in 64 documents) 0.93 against
# 0.71 ms; the dQ atomic adds cost more than the two saved matmuls. It stays selectable
# (TUNESMITH_ATTN_BWD=onepass) for the next try at block sizes or a bulk dQ reduction.
AUTO_ONEPASS = False
# With AUTO_ONEPASS, "auto" takes the one-pass backward from LONG_DOCUMENT tokens in the longest
# document (engine.kernels.varlen_attention's bucket, which also keeps long and short documents'
# configs apart in the autotuner).
# Upper bound of the fp32 dQ accumulator: "auto" keeps the split backward above it, and an explicit
# "onepass" runs the key/value heads in several launches. W6 needs 268 MB, Qwen3-8B at 32k 537 MB.
DQ_BUFFER_BYTES = 1024 * 1024 * 1024


def resolve_backward(requested: Optional[str], longest: Optional[int], dq_buffer_bytes: int = 0) -> str:
    """The backward to run, "split" or "onepass", for a call whose longest document is `longest`
    tokens (None: unknown) and whose whole fp32 dQ buffer (T x Hq x D x 4) is `dq_buffer_bytes`.

    `requested` (a call's `backward`) wins over the environment; "auto" picks by document length and
    buffer size."""
    choice = requested if requested is not None else os.environ.get(BACKWARD_ENV, "auto")
    choice = str(choice).strip().lower() or "auto"
    if choice not in BACKWARDS:
        source = "backward" if requested is not None else BACKWARD_ENV
        raise ValueError(f"{source}={choice!r}: the attention backward must be one of {', '.join(BACKWARDS)}")
    if choice == "auto":
        long_docs = AUTO_ONEPASS and longest is not None and longest >= LONG_DOCUMENT
        return "onepass" if long_docs and dq_buffer_bytes <= DQ_BUFFER_BYTES else "split"
    return choice


def onepass_allowed() -> bool:
    """False (counted as a fallback) when torch is asked for deterministic algorithms."""
    if torch.are_deterministic_algorithms_enabled():
        count_fallback("attention_backward", "deterministic algorithms requested; dQ's atomic adds are not")
        return False
    return True


@triton.jit
def _onepass_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    dq_base,
    lse_base,
    delta_base,
    sq_t,
    sdo_t,
    sdq_t,
    offs_n,
    offs_d,
    lo,
    hi,
    doc_end,
    sm_scale,
    mul_a,
    mul_b,
    window,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        # Addresses rebuilt per step rather than carried through the loop: three [BLOCK_M, D] tiles
        # of 64-bit pointers held across iterations cost the registers the dK/dV accumulators need.
        rows = offs_m.to(tl.int64)
        q_ptrs = q_base + rows[:, None] * sq_t + offs_d[None, :]
        do_ptrs = do_base + rows[:, None] * sdo_t + offs_d[None, :]
        dq_ptrs = dq_base + rows[:, None] * sdq_t + offs_d[None, :]
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
        # Transposed tiles ([keys, queries]) as in the split dK/dV kernel.
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
        ds16 = dsT.to(q.dtype)
        dk = tl.dot(ds16, q, dk, input_precision=DOT_PREC)
        # This key block's share of dQ for these queries, scaled here so the buffer is dQ itself.
        dq = tl.dot(tl.trans(ds16), k, input_precision=DOT_PREC) * sm_scale
        if MASK:
            tl.atomic_add(dq_ptrs, dq, mask=m_ok[:, None], sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


# long_docs is not specialised: 0 and 1 would otherwise compile two copies of every config.
@triton.jit(do_not_specialize=["long_docs"])
def _attn_bwd_onepass(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    DQ,
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
    sdq_t,
    sdq_h,
    s_lse,
    sm_scale,
    mul_a,
    mul_b,
    window,
    kv0,
    long_docs,  # unused in the body: the autotuner's key, so long and short documents tune apart
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # DQ holds the query heads of key/value heads [kv0, kv0 + grid size) only (a chunk).
    local = tl.program_id(0)
    kvh = kv0 + local
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

    # Queries that see this key block, as in the split dK/dV kernel: a masked diagonal, unmasked
    # whole query steps, and a masked tail at the document's end.
    q_lo, diag_end, full_end, q_hi = _query_range(n0, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)

    for g in range(GROUP):
        head = kvh * GROUP + g
        q_base = Q + head * sq_h
        do_base = DO + head * sdo_h
        dq_base = DQ + (local * GROUP + g) * sdq_h
        lse_base = LSE + head * s_lse
        delta_base = DELTA + head * s_lse
        dk, dv = _onepass_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            dq_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            sdq_t,
            offs_n,
            offs_d,
            q_lo,
            diag_end,
            doc_end,
            sm_scale,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
        )
        dk, dv = _onepass_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            dq_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            sdq_t,
            offs_n,
            offs_d,
            diag_end,
            full_end,
            doc_end,
            sm_scale,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            False,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
        )
        dk, dv = _onepass_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            dq_base,
            lse_base,
            delta_base,
            sq_t,
            sdo_t,
            sdq_t,
            offs_n,
            offs_d,
            full_end,
            q_hi,
            doc_end,
            sm_scale,
            mul_a,
            mul_b,
            window,
            BLOCK_M,
            True,
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PREC,
        )
    dk = dk * sm_scale
    tl.store(DK + kvh * sdk_h + rows[:, None] * sdk_t + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DV + kvh * sdv_h + rows[:, None] * sdv_t + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------

# BLOCK_N is the key block (the table's block, one of varlen_attention_configs.TABLE_BLOCKS), BLOCK_M the
# query step. A step's atomics ([BLOCK_M, D] fp32) against its matmuls (5 x BLOCK_M x BLOCK_N x D)
# fall as BLOCK_N grows, so long documents take 128-key blocks where registers allow; short packed
# documents take 64, which wastes less of the masked diagonal and gives more programs. Chosen by
# register spills (ptxas -v for sm_90a, Triton 3.9, causal bf16, GROUP 4), pending GPU timings:
# D=64: (64, 128, 8 warps) 248 registers, no spill; (32, 64, 8) 223, none; any 4-warp tile spills.
# D=128: everything spills a little: (32, 64, 8) 224 bytes, (64, 64, 8) 480, (32, 128, 8) 840,
# (64, 128, 8) 1,964 (the split dK/dV kernel's default spills 1,444). D=256: 1.8 KB at best.
# (Read with plain `ptxas -v`; with the flags Triton itself passes, `python -m bench.attention_regs` finds
# the split dK/dV default at D=128 spilling 32 bytes before its addresses were rebuilt per step, none
# after: bench/results/attention_regs.jsonl.)
_ONEPASS_DEFAULTS = {
    # head_dim: {long documents: (BLOCK_M, BLOCK_N, num_warps, num_stages)}
    64: {False: (32, 64, 8, 3), True: (64, 128, 8, 2)},
    128: {False: (32, 64, 8, 2), True: (32, 128, 8, 2)},
    256: {False: (16, 64, 8, 2), True: (16, 64, 8, 2)},
}
# Autotuned candidates (TUNESMITH_ATTN_AUTOTUNE, as the other attention kernels); the key adds
# whether the documents are long, so W6 and W1 tune apart.
_ONEPASS_CONFIGS = {
    64: [_cfg(64, 128, 8, 2), _cfg(32, 128, 8, 2), _cfg(32, 128, 8, 3), _cfg(64, 64, 8, 2), _cfg(32, 64, 8, 3)],
    128: [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _cfg(32, 64, 8, 2), _cfg(64, 64, 8, 2), _cfg(16, 64, 8, 2)],
    256: [_cfg(16, 64, 8, 2), _cfg(32, 64, 8, 2), _cfg(16, 64, 4, 2)],
}
_attn_bwd_onepass_tuned = _tuned(
    _attn_bwd_onepass, _ONEPASS_CONFIGS, key=_ALL_KEY + ["long_docs"], reset_to_zero=["DQ"]
)


def tuned_config() -> Optional[str]:
    """The autotuner's last pick for the one-pass kernel (for benchmark records), None before any."""
    best = getattr(_attn_bwd_onepass_tuned, "best_config", None)
    return str(best) if best is not None else None


def onepass_defaults(d: int, long_docs: bool) -> dict:
    """{head_dim: (BLOCK_M, BLOCK_N, num_warps, num_stages)} for untuned launches."""
    near = d if d in _ONEPASS_DEFAULTS else min(_ONEPASS_DEFAULTS, key=lambda x: abs(x - d))
    return {d: _ONEPASS_DEFAULTS[near][long_docs]}


def kv_head_chunk(t: int, hkv: int, group: int, d: int, budget: Optional[int] = None) -> int:
    """Key/value heads per launch so the fp32 dQ buffer [T, chunk x group, D] stays under `budget`
    (default DQ_BUFFER_BYTES); the chunks are made even (8 heads over a 2-chunk budget run as 4 + 4,
    not 7 + 1)."""
    budget = DQ_BUFFER_BYTES if budget is None else budget
    per_head = max(t, 1) * group * d * 4
    fit = max(1, min(hkv, budget // per_head))
    n_chunks = -(-hkv // fit)
    return -(-hkv // n_chunks)


def onepass_backward(do, q, k, v, o, lse, L: _Launch):
    """dQ, dK, dV of one varlen attention call in one kernel (after delta = rowsum(dO * O))."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if L.t == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = backward_delta(o, do, lse, L)
    if not L.covers_all:
        dk.zero_()
        dv.zero_()
    long_docs = L.longest is not None and L.longest >= LONG_DOCUMENT
    defaults = onepass_defaults(L.d, long_docs)
    chunk = kv_head_chunk(L.t, L.hkv, L.group, L.d)
    for kv0 in range(0, L.hkv, chunk):
        heads = min(chunk, L.hkv - kv0)
        h0, h1 = kv0 * L.group, (kv0 + heads) * L.group
        # The whole stream's rows for these heads: tokens outside every document keep a zero dQ.
        acc = torch.zeros((L.t, h1 - h0, L.d), dtype=torch.float32, device=q.device)
        tail = (
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            do.stride(0),
            do.stride(1),
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            acc.stride(0),
            acc.stride(1),
            lse.stride(0),
            L.scale,
            L.mul_a,
            L.mul_b,
            L.window,
            kv0,
            int(long_docs),
        )
        L.run(
            "onepass",
            _attn_bwd_onepass_tuned,
            _attn_bwd_onepass,
            heads,
            (q, k, v, do, dk, dv, acc, lse, delta, L.cu),
            tail,
            defaults=defaults,
        )
        if h1 - h0 == L.hq:
            dq.copy_(acc)
        else:
            dq[:, h0:h1].copy_(acc)
    return dq, dk, dv
