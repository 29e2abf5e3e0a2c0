"""MoE expert-row kernels: the gated activation of the gate/up products (forward, and a one-pass
backward) and the weighted gather-combine of expert rows back to tokens.

These serve the grouped MoE forward (engine.fastpath.moe), whose expert rows are sorted by expert:

- `glu_forward`: h = act(g) * u per row of gate/up products [rows, 2I] -> [rows, I], with a
  per-expert bias added first (GPT-OSS). act "silu" (Qwen3-MoE) or "gptoss" (GPT-OSS's clamped
  GLU, ``(clamp(u) + 1) * g' * sigmoid(alpha * g')``, ``g' = min(g, limit)``); layout "concat"
  ([gate | up]) or "interleaved" (gate at even, up at odd columns).
- `glu_backward`: d gate/up for the output gradient ``gd * w_s`` (each row's routing weight)
  and, for the scores' gradient, the per-row ``<gd, h>`` in fp32 without storing h. The Triton
  path writes d gate/up over `gu` (the caller's saved products, not needed afterwards).
- `combine`: ``out[t] = base[t] + sum_j w[t, j] * src[inv[t*k + j]]`` (w None: a plain sum),
  summed in fp32.

Each comes as `*_reference` (plain torch, fp32 math: what a CPU runs), `*_triton` (the kernel on
any device; CPU tensors need TRITON_INTERPRET=1) and the entry point with a `use_triton` switch
(the caller decides: the MoE plan's kernels setting). Triton is optional here: without it
`TRITON_AVAILABLE` is False and only the references exist.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # Triton is optional: without it every path is plain torch
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton ships with torch on Linux
    triton = None

TRITON_AVAILABLE = triton is not None

LAYOUTS = ("concat", "interleaved")
ACTS = ("silu", "gptoss")


# -- torch references -------------------------------------------------------------------------------


def split_gate_up(t: torch.Tensor, layout: str):
    """(gate, up) column views of gate/up products [rows, 2I] in `layout`."""
    inter = t.shape[1] // 2
    if layout == "concat":
        return t[:, :inter], t[:, inter:]
    return t[:, 0::2], t[:, 1::2]


def _biased(gu: torch.Tensor, eid, bias) -> torch.Tensor:
    gu32 = gu.float()
    if bias is not None:
        gu32 = gu32 + bias.float().index_select(0, eid)
    return gu32


def glu_forward_reference(
    gu: torch.Tensor,
    eid: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    *,
    layout: str,
    act: str,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """act(gate) * up of gate/up products [rows, 2I] -> [rows, I] in fp32, cast once.

    bias [E, 2I] (or None) is added first, row r taking expert eid[r]'s."""
    g, u = split_gate_up(_biased(gu, eid, bias), layout)
    if act == "silu":
        h = F.silu(g) * u
    else:  # GPT-OSS, as GptOssExperts._apply_gate
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        h = (u + 1) * (g * torch.sigmoid(g * alpha))
    return h.to(gu.dtype)


def glu_backward_reference(
    gd: torch.Tensor,
    w_s: torch.Tensor,
    gu: torch.Tensor,
    eid,
    bias,
    *,
    layout: str,
    act: str,
    alpha: float = 0.0,
    limit: float = 0.0,
    need_dot: bool = True,
):
    """(d gate_up [rows, 2I] for the output gradient gd * w_s[:, None], per-row <gd, h> in fp32
    or None). New tensors; `gu` is left as it is."""
    g, u = split_gate_up(_biased(gu, eid, bias), layout)
    gd32 = gd.float()
    dh = gd32 * w_s.float()[:, None]
    if act == "silu":
        sig = torch.sigmoid(g)
        a = g * sig
        dg = dh * u * sig * (1 + g * (1 - sig))
        du = dh * a
        h = a * u
    else:
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(gc * alpha)
        glu = gc * sig
        # clamp passes the gradient where its input lies in the closed interval (as torch's).
        dg = torch.where(g <= limit, dh * (uc + 1) * (sig + alpha * gc * sig * (1 - sig)), 0.0)
        du = torch.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
        h = (uc + 1) * glu
    g_gu = torch.stack([dg, du], -1).flatten(1) if layout == "interleaved" else torch.cat([dg, du], 1)
    return g_gu.to(gu.dtype), ((gd32 * h).sum(-1) if need_dot else None)


def combine_reference(
    src: torch.Tensor,
    inv: torch.Tensor,
    w: Optional[torch.Tensor],
    base: Optional[torch.Tensor],
    n_tok: int,
    k: int,
    out_dtype,
) -> torch.Tensor:
    """out[t] = base[t] + sum_j w[t, j] * src[inv[t*k + j]] (w None: a plain sum); fp32 sums."""
    rows = src.index_select(0, inv).view(n_tok, k, -1)
    if w is None:
        return rows.sum(1, dtype=torch.float32).to(out_dtype)
    out = torch.bmm(w.to(rows.dtype).view(n_tok, 1, k), rows).view(n_tok, -1)
    if base is not None:
        out = out.float() + base
    return out.to(out_dtype)


# -- Triton kernels ---------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _act_load(
        GU, B, EID, row, cols, mask, n_inter, stride_gu, stride_b, LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr
    ):
        if LAYOUT == 0:
            g_off = cols
            u_off = cols + n_inter
        else:
            g_off = 2 * cols
            u_off = 2 * cols + 1
        g = tl.load(GU + row * stride_gu + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + u_off, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(EID + row).to(tl.int64)
            g += tl.load(B + e * stride_b + g_off, mask=mask, other=0.0).to(tl.float32)
            u += tl.load(B + e * stride_b + u_off, mask=mask, other=0.0).to(tl.float32)
        return g, u, g_off, u_off

    @triton.jit
    def _moe_act_fwd_kernel(
        GU,
        B,
        EID,
        H,
        n_inter,
        stride_gu,
        stride_b,
        stride_h,
        alpha,
        limit,
        LAYOUT: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_inter
        g, u, g_off, u_off = _act_load(GU, B, EID, row, cols, mask, n_inter, stride_gu, stride_b, LAYOUT, HAS_BIAS)
        if ACT == 0:  # silu(g) * u
            h = g / (1.0 + tl.exp(-g)) * u
        else:  # GPT-OSS: (clamp(u) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)
            gc = tl.minimum(g, limit)
            uc = tl.minimum(tl.maximum(u, -limit), limit)
            h = (uc + 1.0) * gc / (1.0 + tl.exp(-alpha * gc))
        tl.store(H + row * stride_h + cols, h.to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_act_bwd_kernel(
        GD,
        WS,
        GU,
        B,
        EID,
        DOT,
        n_inter,
        stride_gd,
        stride_gu,
        stride_b,
        alpha,
        limit,
        LAYOUT: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        NEED_DOT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One row per program: reads gd, the row's routing weight and gate/up once, writes
        # d gate/up over gate/up (the program owns the row, so in place is race-free) and,
        # for the scores' gradient, the row dot <gd, h> without ever storing h.
        row = tl.program_id(0).to(tl.int64)
        ws = tl.load(WS + row).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_inter, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_inter
            g, u, g_off, u_off = _act_load(GU, B, EID, row, cols, mask, n_inter, stride_gu, stride_b, LAYOUT, HAS_BIAS)
            gd = tl.load(GD + row * stride_gd + cols, mask=mask, other=0.0).to(tl.float32)
            dh = gd * ws
            if ACT == 0:
                sig = 1.0 / (1.0 + tl.exp(-g))
                a = g * sig
                dg = dh * u * sig * (1.0 + g * (1.0 - sig))
                du = dh * a
                h = a * u
            else:
                gc = tl.minimum(g, limit)
                uc = tl.minimum(tl.maximum(u, -limit), limit)
                sig = 1.0 / (1.0 + tl.exp(-alpha * gc))
                glu = gc * sig
                dg = tl.where(g <= limit, dh * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
                du = tl.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
                h = (uc + 1.0) * glu
            tl.store(GU + row * stride_gu + g_off, dg.to(GU.dtype.element_ty), mask=mask)
            tl.store(GU + row * stride_gu + u_off, du.to(GU.dtype.element_ty), mask=mask)
            if NEED_DOT:
                dot += tl.where(mask, gd * h, 0.0)
        if NEED_DOT:
            tl.store(DOT + row, tl.sum(dot, axis=0))

    @triton.jit
    def _combine_kernel(
        SRC,
        INV,
        W,
        BASE,
        OUT,
        n_cols,
        stride_src,
        stride_base,
        stride_out,
        K: tl.constexpr,
        HAS_W: tl.constexpr,
        HAS_BASE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One token's k rows gathered and reduced in registers: the [T*k, H] unsorted copy
        # a torch gather would write (and the reduction read back) never exists.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        if HAS_BASE:
            acc = tl.load(BASE + t * stride_base + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            pos = tl.load(INV + t * K + j).to(tl.int64)
            v = tl.load(SRC + pos * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(W + t * K + j).to(tl.float32)
            acc += v
        tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def _blocks(n_cols: int) -> tuple[int, int]:
    block = min(1024, triton.next_power_of_2(max(n_cols, 16)))
    return block, (4 if block >= 512 else 2)


def _codes(layout: str, act: str) -> tuple[int, int]:
    return 0 if layout == "concat" else 1, 0 if act == "silu" else 1


def glu_forward_triton(
    gu: torch.Tensor,
    eid: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    *,
    layout: str,
    act: str,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """`glu_forward_reference` by the Triton kernel (a new [rows, I] tensor)."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(rows, inter, device=gu.device, dtype=gu.dtype)
    if rows:
        block, warps = _blocks(inter)
        layout_code, act_code = _codes(layout, act)
        _moe_act_fwd_kernel[(rows, triton.cdiv(inter, block))](
            gu,
            bias if bias is not None else gu,
            eid if eid is not None else gu,
            h,
            inter,
            gu.stride(0),
            bias.stride(0) if bias is not None else 0,
            h.stride(0),
            alpha,
            limit,
            LAYOUT=layout_code,
            ACT=act_code,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=warps,
        )
    return h


def glu_backward_triton(
    gd: torch.Tensor,
    w_s: torch.Tensor,
    gu: torch.Tensor,
    eid,
    bias,
    *,
    layout: str,
    act: str,
    alpha: float = 0.0,
    limit: float = 0.0,
    need_dot: bool = True,
):
    """`glu_backward_reference` by the one-pass kernel, which writes d gate_up over `gu` and
    returns it (gu's unit last stride is assumed: the caller's own GEMM output)."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    dot = torch.empty(rows, device=gu.device, dtype=torch.float32) if need_dot else None
    if rows:
        block, warps = _blocks(inter)
        layout_code, act_code = _codes(layout, act)
        gd = gd if gd.stride(-1) == 1 else gd.contiguous()
        _moe_act_bwd_kernel[(rows,)](
            gd,
            w_s,
            gu,
            bias if bias is not None else gu,
            eid if eid is not None else gu,
            dot if dot is not None else gu,
            inter,
            gd.stride(0),
            gu.stride(0),
            bias.stride(0) if bias is not None else 0,
            alpha,
            limit,
            LAYOUT=layout_code,
            ACT=act_code,
            HAS_BIAS=bias is not None,
            NEED_DOT=need_dot,
            BLOCK=block,
            num_warps=warps,
        )
        # The kernel overwrote a saved tensor behind autograd's back: bump its version so a
        # second backward over a retained graph fails loudly instead of reading gradients.
        bump = getattr(torch.autograd.graph, "increment_version", None)
        if bump is not None:
            bump(gu)
    return gu, dot


def combine_triton(
    src: torch.Tensor,
    inv: torch.Tensor,
    w: Optional[torch.Tensor],
    base: Optional[torch.Tensor],
    n_tok: int,
    k: int,
    out_dtype,
) -> torch.Tensor:
    """`combine_reference` by the Triton kernel (base, when given, is fp32 [n_tok, cols])."""
    n_cols = src.shape[1]
    out = torch.empty(n_tok, n_cols, device=src.device, dtype=out_dtype)
    if n_tok:
        src = src if src.stride(-1) == 1 else src.contiguous()
        w = w.contiguous() if w is not None else None
        block, warps = _blocks(n_cols)
        _combine_kernel[(n_tok, triton.cdiv(n_cols, block))](
            src,
            inv,
            w if w is not None else src,
            base if base is not None else src,
            out,
            n_cols,
            src.stride(0),
            base.stride(0) if base is not None else 0,
            out.stride(0),
            K=k,
            HAS_W=w is not None,
            HAS_BASE=base is not None,
            BLOCK=block,
            num_warps=warps,
        )
    return out


# -- entry points -----------------------------------------------------------------------------------


def glu_forward(
    gu, eid, bias, *, layout: str, act: str, alpha: float = 0.0, limit: float = 0.0, use_triton: bool = False
) -> torch.Tensor:
    """The gated activation of gate/up products [rows, 2I] -> [rows, I] (bias added first)."""
    fn = glu_forward_triton if use_triton else glu_forward_reference
    return fn(gu, eid, bias, layout=layout, act=act, alpha=alpha, limit=limit)


def glu_backward(
    gd,
    w_s,
    gu,
    eid,
    bias,
    *,
    layout: str,
    act: str,
    alpha: float = 0.0,
    limit: float = 0.0,
    need_dot: bool = True,
    use_triton: bool = False,
):
    """(d gate_up for the output gradient gd * w_s, per-row <gd, h> in fp32 or None).

    The Triton path writes d gate_up over `gu` (saved products, not needed afterwards)."""
    fn = glu_backward_triton if use_triton else glu_backward_reference
    return fn(gd, w_s, gu, eid, bias, layout=layout, act=act, alpha=alpha, limit=limit, need_dot=need_dot)


def combine(src, inv, w, base, n_tok: int, k: int, out_dtype, use_triton: bool = False) -> torch.Tensor:
    """out[t] = base[t] + sum_j w[t, j] * src[inv[t*k + j]] (w None: a plain sum); fp32 sums."""
    if use_triton:
        return combine_triton(src, inv, w, base, n_tok, k, out_dtype)
    return combine_reference(src, inv, w, base, n_tok, k, out_dtype)
