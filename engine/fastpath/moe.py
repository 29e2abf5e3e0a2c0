"""Grouped expert routing for transformers' native-torch MoE blocks (frozen experts).

Supported blocks: Qwen3-MoE's `Qwen3MoeSparseMoeBlock` and GPT-OSS's `GptOssMLP` (the
transformers 5.x layout: a router module returning (logits, scores, indices) and an experts
module holding 3D `gate_up_proj` / `down_proj` tensors). The patched forward

1. routes once: the block's own router module (so each architecture's softmax / top-k /
   normalisation / bias semantics are transformers' own, and router hooks still fire);
2. flattens the (token, slot) pairs, sorts them by expert id (stable) and finds each expert's
   end offset with `searchsorted` on the sorted ids (a CUDA `bincount` would read the maximum
   back to the host to size its output; `searchsorted` never does);
3. gathers the tokens into expert-contiguous rows and runs the two expert matmuls per group:
   `torch.nn.functional.grouped_mm` (or `torch._grouped_mm`) with the offsets on CUDA bf16 --
   no host sync at all -- otherwise a loop over experts that reads the offsets to the host
   once per block call (one `.tolist()`, counted as "host_syncs" in engine.counters);
4. combines the slots back per token, weighted by the routing scores, accumulating in fp32.

Steps 3-4 are one autograd.Function (`grouped_experts`). The experts are frozen, so its
backward produces no weight gradients: only d hidden states and d routing scores (the scores
are a function of the hidden states through the router even when the router is frozen; that
gradient flows on through the router's own autograd, as in the stock block). It saves the
sort (order, inverse order, token of each row, offsets, each row's score) and the gate/up
products [T*k, 2I]; the activation is recomputed in the backward, whose one-pass kernel
writes d(gate/up) over the saved products and the per-row <d act, act> the scores need, so
neither the activation output nor the down projection output is kept. On CUDA the
activations (SiLU-GLU; GPT-OSS's clamped, interleaved, biased GLU) and the gather-combine
are Triton kernels (engine.kernels.moe, beside their torch references); elsewhere plain torch
in fp32.

Public: `apply_moe_grouping(model)` (-> "on" / "partial k/n: why" / "off: why"),
`remove_moe_grouping(model)`, `group_block(block)`, `ungroup_block(block)`,
`block_unsupported_reason(block)`, `grouped_experts(...)`, `matmul_path(...)`; its counts go to engine.counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Block calls through the grouped path and host syncs the routing made (the loop path reads the
# expert offsets once per call; the grouped_mm path never does) go to engine.counters, where
# the training loop reads them with the packing counts.
from engine.counters import count, count_fallback, reset_counters  # noqa: F401
from engine.fastpath import patching
from engine.kernels import moe as moe_kernels

_KIND = "moe"  # engine.fastpath.patching kind of the grouped forward
# transformers model types whose sparse blocks this module groups.
MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")
_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# -- what a supported block looks like -------------------------------------------------------------


@dataclass
class _Plan:
    stock: Callable
    router_attr: str  # "gate" (Qwen3-MoE) or "router" (GPT-OSS)
    layout: str  # "concat": [gate | up]; "interleaved": gate at even, up at odd columns
    act: str  # "silu", "gptoss" (clamped GLU), "generic" (act_fn recomputed under autograd)
    act_fn: Optional[Callable]
    transposed: bool  # weights stored for x @ W (GPT-OSS) rather than F.linear's x @ W.T
    has_bias: bool
    returns_scores: bool  # GPT-OSS's block returns (hidden, router_scores)
    alpha: float = 0.0
    limit: float = 0.0
    impl: str = "auto"  # expert matmuls: "auto", "grouped_mm", "loop"
    kernels: str = "auto"  # activations / combine: "auto" (Triton on CUDA), "triton", "torch"


def _is_silu(act_fn) -> bool:
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def _params_plain(mod: nn.Module, names) -> Optional[str]:
    for n in names:
        p = getattr(mod, n, None)
        # PEFT's parameter-targeting LoRA (target_parameters) replaces these with wrappers.
        if not isinstance(p, torch.Tensor):
            return f"{type(mod).__name__}.{n} is not a plain tensor"
    if any("lora" in name.lower() for name, _ in mod.named_modules()):
        return "LoRA adapters on the experts are not supported (experts must be frozen)"
    return None


def _plan_for(block: nn.Module) -> tuple[Optional[_Plan], Optional[str]]:
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    if name == "Qwen3MoeSparseMoeBlock":
        router, router_attr = getattr(block, "gate", None), "gate"
        if any(hasattr(block, a) for a in ("shared_expert", "shared_experts")):
            return None, "shared experts are not supported"
        wanted = ("gate_up_proj", "down_proj")
    elif name == "GptOssMLP":
        router, router_attr = getattr(block, "router", None), "router"
        wanted = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    else:
        return None, f"{name} is not a supported MoE block (Qwen3MoeSparseMoeBlock, GptOssMLP)"
    wrapped = [m for m in (experts, router) if m is not None and hasattr(m, "get_base_layer")]
    if wrapped:
        # PEFT's all-linear also targets 3-D expert weights and the router (ParamWrapper).
        return None, (
            "PEFT adapters on the experts or the router (LoRA here trains only what "
            "leaves experts frozen: target the attention projections)"
        )
    if experts is None or router is None or not hasattr(router, "top_k"):
        return None, f"{name} has an unknown layout (transformers < 5?)"
    why = _params_plain(experts, wanted)
    if why:
        return None, why
    e = getattr(experts, "num_experts", None)
    gu, down = experts.gate_up_proj, experts.down_proj
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != e or down.shape[0] != e:
        return None, f"{name}: unexpected expert weight shapes {tuple(gu.shape)}, {tuple(down.shape)}"
    stock = block.forward
    if name == "Qwen3MoeSparseMoeBlock":
        # gate_up_proj [E, 2I, H] and down_proj [E, H, I], used as F.linear weights.
        if gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
            return None, f"{name}: gate_up/down shapes do not match"
        act_fn = getattr(experts, "act_fn", None)
        if act_fn is None:
            return None, f"{name}: experts have no act_fn"
        return _Plan(
            stock,
            router_attr,
            "concat",
            "silu" if _is_silu(act_fn) else "generic",
            act_fn,
            transposed=False,
            has_bias=False,
            returns_scores=False,
        ), None
    # GPT-OSS: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H], both used as x @ W.
    if gu.shape[2] != 2 * down.shape[1] or gu.shape[1] != down.shape[2]:
        return None, f"{name}: gate_up/down shapes do not match"
    if not (hasattr(experts, "alpha") and hasattr(experts, "limit")):
        return None, f"{name}: experts have no alpha/limit"
    return _Plan(
        stock,
        router_attr,
        "interleaved",
        "gptoss",
        None,
        transposed=True,
        has_bias=True,
        returns_scores=True,
        alpha=float(experts.alpha),
        limit=float(experts.limit),
    ), None


def block_unsupported_reason(block: nn.Module) -> Optional[str]:
    """None when `block` can take the grouped forward, else why not."""
    why = _plan_for(block)[1]
    if why is None and any(p.requires_grad for p in block.experts.parameters()):
        why = "the experts are trainable (the grouped path has no expert-weight gradients)"
    return why


def _looks_like_moe(module: nn.Module) -> bool:
    return hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router"))


# -- installing ----------------------------------------------------------------------------------


def group_block(block: nn.Module, *, impl: str = "auto", kernels: str = "auto") -> nn.Module:
    """Give one MoE block the grouped forward (in place); ValueError when it is unsupported.

    impl: "auto" (grouped_mm on CUDA bf16, else the loop), "grouped_mm" or "loop".
    kernels: "auto" (Triton on CUDA), "triton" (also on CPU tensors: TRITON_INTERPRET tests)
    or "torch".
    """
    if impl not in ("auto", "grouped_mm", "loop"):
        raise ValueError(f"impl must be auto, grouped_mm or loop, got {impl!r}")
    if kernels not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels must be auto, triton or torch, got {kernels!r}")
    ungroup_block(block)
    plan, why = _plan_for(block)
    if plan is None:
        raise ValueError(why)
    plan.impl, plan.kernels = impl, kernels
    patching.install(block, _grouped_forward, plan, _KIND)
    return block


def ungroup_block(block: nn.Module) -> bool:
    """Restore the stock forward; True when there was a grouped one."""
    return patching.uninstall(block, _KIND)


def remove_moe_grouping(model: nn.Module) -> int:
    return sum(ungroup_block(m) for m in list(model.modules()))


def apply_moe_grouping(model: nn.Module, *, impl: str = "auto", kernels: str = "auto") -> str:
    """Patch every supported MoE block of a (PEFT-wrapped or plain) model; unsupported ones
    keep the stock forward. Returns "on", "partial k/n: <why>" or "off: <why>"."""
    remove_moe_grouping(model)
    blocks = [m for m in model.modules() if _looks_like_moe(m)]
    if not blocks:
        return "off: no MoE blocks in this model"
    done, reasons = 0, []
    for b in blocks:
        why = block_unsupported_reason(b)
        if why is None:
            group_block(b, impl=impl, kernels=kernels)
            done += 1
        elif why not in reasons:
            reasons.append(why)
    if done == len(blocks):
        return "on"
    if done == 0:
        return "off: " + "; ".join(reasons)
    return f"partial {done}/{len(blocks)}: " + "; ".join(reasons)


# -- the patched forward ---------------------------------------------------------------------------


def _runtime_reason(block: nn.Module, x: torch.Tensor) -> Optional[str]:
    """Why this call must take the stock forward (None: it can be grouped)."""
    ex = block.experts
    w = ex.gate_up_proj
    if x.dim() != 3 or x.numel() == 0:
        return "shape"
    if torch.is_grad_enabled() and any(p.requires_grad for p in ex.parameters()):
        return "trainable experts"  # the Function has no expert-weight gradients
    if x.dtype != w.dtype or x.device != w.device:
        return "dtype/device"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast"  # the stock path knows how transformers wants autocast handled
    return None


def _grouped_forward(self, plan: _Plan, hidden_states: torch.Tensor):
    reason = _runtime_reason(self, hidden_states)
    if reason is not None:
        count_fallback("moe", reason)
        return plan.stock(hidden_states)
    b, t, h = hidden_states.shape
    x = hidden_states.reshape(-1, h)
    _, scores, indices = getattr(self, plan.router_attr)(x)
    out = grouped_experts(x, scores, indices, self.experts, plan).reshape(b, t, h)
    return (out, scores) if plan.returns_scores else out


def _dims(experts: nn.Module, plan: Optional[_Plan]) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of an experts module."""
    gu, down = experts.gate_up_proj, experts.down_proj
    if plan is not None and plan.transposed:  # [E, H, 2I], [E, I, H]
        return gu.shape[0], gu.shape[1], down.shape[1]
    return gu.shape[0], gu.shape[2], down.shape[2]  # [E, 2I, H], [E, H, I]


def matmul_path(block: nn.Module, dtype: torch.dtype, device) -> str:
    """ "grouped_mm" or "loop": what the grouped forward of `block` uses for such inputs."""
    patch = patching.installed(block, _KIND)
    plan = patch.plan if patch is not None else _plan_for(block)[0]
    if plan is None:
        return "stock"
    n_exp, hidden, inter = _dims(block.experts, plan)
    return "grouped_mm" if _use_grouped_mm(plan.impl, dtype, torch.device(device), n_exp, inter, hidden) else "loop"


_CAPS: dict[int, tuple[int, int]] = {}


def _use_grouped_mm(impl: str, dtype, device: torch.device, n_experts: int, inter: int, hidden: int) -> bool:
    if impl == "loop":
        return False
    if impl == "grouped_mm":
        if _GMM is None:
            raise RuntimeError("this torch has no grouped_mm (torch.nn.functional.grouped_mm / torch._grouped_mm)")
        return True
    if _GMM is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    # The grouped GEMM kernels want 16-byte aligned row strides (8 bf16 values) and SM80+.
    if inter % 8 or hidden % 8:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPS:
        _CAPS[idx] = torch.cuda.get_device_capability(idx)
    return _CAPS[idx] >= (8, 0)


def _use_triton(kernels: str, x: torch.Tensor) -> bool:
    if not moe_kernels.TRITON_AVAILABLE or kernels == "torch":
        return False
    return kernels == "triton" or x.is_cuda


# -- the grouped experts ---------------------------------------------------------------------------


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: nn.Module, plan: _Plan
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{indices[t, j]}(x[t]) for x [T, H]; frozen experts."""
    ex = experts
    if plan.act == "gptoss":  # read per call, like the stock forward does
        plan.alpha, plan.limit = float(ex.alpha), float(ex.limit)
    b_gu = ex.gate_up_proj_bias if plan.has_bias else None
    b_d = ex.down_proj_bias if plan.has_bias else None
    count("moe_calls")
    return _GroupedExperts.apply(x, weights, indices, plan, ex.gate_up_proj, ex.down_proj, b_gu, b_d)


def _gmm(a: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor, host: Optional[list]) -> torch.Tensor:
    """Rows of `a` grouped by `offs` (group ends) times w3[g] ([E, K, N]) -> [rows, N]."""
    if host is None:
        return _GMM(a, w3, offs=offs)
    out = a.new_empty(a.shape[0], w3.shape[2])
    start = 0
    for g, end in enumerate(host):  # empty experts cost nothing
        if end > start:
            torch.mm(a[start:end], w3[g], out=out[start:end])
        start = end
    return out


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, indices, plan, w_gu, w_d, b_gu, b_d):
        n_tok = x.shape[0]
        k = indices.shape[1]
        n_exp = w_gu.shape[0]
        hidden = x.shape[1]
        inter = w_d.shape[1] if plan.transposed else w_d.shape[2]
        dev = x.device

        # Route: (token, slot) pairs sorted by expert; group ends from the sorted ids.
        flat = indices.reshape(-1)
        sorted_e, order = torch.sort(flat, stable=True)
        offs = torch.searchsorted(
            sorted_e, torch.arange(n_exp, device=dev, dtype=sorted_e.dtype), right=True, out_int32=True
        )
        host = None
        if not _use_grouped_mm(plan.impl, x.dtype, dev, n_exp, inter, hidden):
            host = offs.tolist()  # the one host read of this block call (kept for the backward)
            count("host_syncs")
        count("moe:loop" if host is not None else "moe:grouped_mm")
        n_rows = order.numel()
        token_of = torch.div(order, k, rounding_mode="floor")
        # inv[(t, j)] = row of that pair in expert order (a permutation: plain scatter, no sort).
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(n_rows, device=dev, dtype=order.dtype))
        eid = sorted_e if plan.has_bias else None

        # Expert-major forward matrices [E, in, out] (views, no copies).
        fwd_gu = w_gu if plan.transposed else w_gu.transpose(-2, -1)
        fwd_d = w_d if plan.transposed else w_d.transpose(-2, -1)

        use_triton = _use_triton(plan.kernels, x)
        gu = _gmm(x.index_select(0, token_of), fwd_gu, offs, host)
        y = _gmm(_act_forward(gu, eid, b_gu, plan, use_triton), fwd_d, offs, host)
        w = weights.to(y.dtype)
        base = None
        if b_d is not None:
            # sum_j w[t,j] * b_d[e_tj]: one small [T, E] @ [E, H] matmul in fp32.
            dense = torch.zeros(n_tok, n_exp, device=dev, dtype=torch.float32)
            dense.scatter_(1, indices, w.float())
            base = dense @ b_d.float()
        out = _combine(y, inv, w, base, n_tok, k, x.dtype, use_triton)

        ctx.plan, ctx.host, ctx.k, ctx.use_triton = plan, host, k, use_triton
        ctx.x_dtype, ctx.w_dtype = x.dtype, weights.dtype
        w_s = w.reshape(-1).index_select(0, order)  # routing weight of each sorted row
        ctx.save_for_backward(gu, order, inv, token_of, offs, w_s, indices, eid, w_gu, w_d, b_gu, b_d)
        return out

    @staticmethod
    def backward(ctx, g_out):
        gu, order, inv, token_of, offs, w_s, indices, eid, w_gu, w_d, b_gu, b_d = ctx.saved_tensors
        plan, host, k, use_triton = ctx.plan, ctx.host, ctx.k, ctx.use_triton
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return (None,) * 8
        n_tok = g_out.shape[0]
        go = g_out.to(gu.dtype)
        # Backward matrices: transposes of the forward ones (views).
        bwd_d = w_d.transpose(-2, -1) if plan.transposed else w_d
        bwd_gu = w_gu.transpose(-2, -1) if plan.transposed else w_gu

        # gd_s = g_out[t_s] @ W_down^T, before the routing weight: the scores' gradient is
        # <gd_s, h_s>, so the down projection's output never has to be kept or recomputed.
        gd = _gmm(go.index_select(0, token_of), bwd_d, offs, host)
        g_gu, gws = _act_backward(gd, w_s, gu, eid, b_gu, plan, use_triton, need_dot=need_w)
        del gd
        g_w = None
        if need_w:
            g_w = gws.index_select(0, inv).view(n_tok, k)
            if b_d is not None:  # + <g_out_t, b_down[e]>
                g_w = g_w + (go.float() @ b_d.float().t()).gather(1, indices)
            g_w = g_w.to(ctx.w_dtype)
        g_x = None
        if need_x:
            g_x = _combine(_gmm(g_gu, bwd_gu, offs, host), inv, None, None, n_tok, k, ctx.x_dtype, use_triton)
        return g_x, g_w, None, None, None, None, None, None


# -- activation and combine: engine.kernels.moe (Triton on CUDA, its torch reference elsewhere) ----


def _act_forward(gu, eid, bias, plan: _Plan, use_triton: bool) -> torch.Tensor:
    """The gated activation of gate/up products [rows, 2I] -> [rows, I] (bias added first)."""
    if plan.act == "generic":  # any activation, in the model dtype as the stock experts do
        g, u = moe_kernels.split_gate_up(gu, plan.layout)
        return plan.act_fn(g) * u
    return moe_kernels.glu_forward(
        gu, eid, bias, layout=plan.layout, act=plan.act, alpha=plan.alpha, limit=plan.limit, use_triton=use_triton
    )


def _act_backward(gd, w_s, gu, eid, bias, plan: _Plan, use_triton: bool, need_dot: bool):
    """(d gate_up for the output gradient gd * w_s, per-row <gd, h> in fp32 or None).

    The Triton path writes d gate_up over `gu` (saved products, not needed afterwards)."""
    if plan.act == "generic":
        with torch.enable_grad():
            g, u = (t.detach().requires_grad_(True) for t in moe_kernels.split_gate_up(gu, plan.layout))
            h = plan.act_fn(g) * u
            dg, du = torch.autograd.grad(h, (g, u), gd * w_s[:, None].to(gd.dtype))
        dot = (gd.float() * h.detach().float()).sum(-1) if need_dot else None
        return torch.cat([dg, du], 1), dot
    return moe_kernels.glu_backward(
        gd,
        w_s,
        gu,
        eid,
        bias,
        layout=plan.layout,
        act=plan.act,
        alpha=plan.alpha,
        limit=plan.limit,
        need_dot=need_dot,
        use_triton=use_triton,
    )


_combine = moe_kernels.combine
