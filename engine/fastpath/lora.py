"""Fused LoRA projections with hand-derived backward passes: MLP, QKV and O.

A LoRA projection is ``y = x W^T + b + s * (x A^T) B^T`` with the base ``W``/``b`` frozen and
``A`` [r, in], ``B`` [out, r] trained. Plain PEFT runs this as separate autograd ops, saving
every intermediate. Here one `torch.autograd.Function` covers a group of projections:

- `LoRALinears`: projections that share one input (q/k/v, gate/up, or o alone). The A
  matrices of the group are stacked so ``x`` is read once for all low-rank products, and in
  backward the three (or two) rank-r input gradients are one matmul against the stacked A.
- `LoRAMLP`: gate/up, the gated activation, and down. Saves x, gate and up (plus the tiny
  [N, r] products); the activation output is recomputed in backward instead of saved.

Products are bracketed so ``A B`` ([out, in]) is never formed. Gradients flow to x, A and B
only; the base weight is read through `base_weight(layer, dtype)`, the single place where a
4-bit (QLoRA) base is dequantized (engine.fastpath.quant): once in forward and once more in
backward for dx, each copy dropped right after its matmul, never saved for backward.

Gradients (``dy`` = upstream gradient, ``xa = x A^T``):

    dx = dy W + s (dy B) A        dA = s (dy B)^T x        dB = s dy^T xa

Compute dtype: everything runs in the activation dtype (x.dtype); fp32 adapter weights (PEFT
casts adapters to fp32 for bf16 models) are cast down for the matmuls and their gradients are
returned in the adapter's dtype. PEFT instead runs the low-rank branch in the adapter dtype;
the difference is bf16 rounding of a rank-r term, and the matmuls stay on the fast bf16 path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from engine.counters import COUNTERS
from engine.fastpath import quant

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- base layer access: the one place a quantized base plugs in ---------------------------------


def base_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base weight [out, in] as a dense tensor in `dtype`.

    A 4-bit base is dequantized into a fresh tensor: callers use it for one matmul and drop it
    (it is never saved for backward), so one layer's dense weight exists at a time.
    """
    if quant.is_4bit(layer):
        return quant.dequantize(layer, dtype)
    w = layer.weight
    return w if w.dtype == dtype else w.to(dtype)


def base_dtype(layer: nn.Module) -> Optional[torch.dtype]:
    """The activation dtype the stock base layer computes in (None: not usable right now)."""
    if quant.is_4bit(layer):
        return quant.compute_dtype(layer)
    return layer.weight.dtype


def _bias(layer: nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    bias = layer.bias
    return bias if bias is None or bias.dtype == dtype else bias.to(dtype)


def base_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """x @ W^T + b with the frozen base layer (no autograd: called inside Functions)."""
    return F.linear(x, base_weight(layer, x.dtype), _bias(layer, x.dtype))


# Order of the two matmuls of a LoRA projection, y = x W^T + (x A^T)(s B)^T, and of its input
# gradient, dx = dy W + (dy s B) A: the rank-r product is made first and the base GEMM adds onto
# it (beta=1). The other order makes the big output, then reads and writes all of it again to
# add a K=r product, a pass bound by memory (about a tenth of a 14B QLoRA step on the H200);
# this way the only extra traffic is the GEMM epilogue's read of C, which overlaps its math.


def lora_linear_out(x: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """x @ W^T + b + xa @ B^T (B already scaled)."""
    bias = _bias(layer, x.dtype)
    y = torch.mm(xa, B.t()) if bias is None else torch.addmm(bias, xa, B.t())
    return y.addmm_(x, base_weight(layer, x.dtype).t())


# -- what a projection is made of --------------------------------------------------------------


@dataclass(frozen=True)
class LoRAParts:
    """One projection: its frozen base and, when wrapped by PEFT, the active adapter's A/B."""

    layer: nn.Module  # the module the model calls (PEFT wrapper, or the base itself)
    base: nn.Module  # the frozen nn.Linear or 4-bit bitsandbytes Linear4bit
    adapter: Optional[str]  # None: no LoRA on this projection
    scale: float = 0.0

    @property
    def A(self) -> Optional[torch.Tensor]:
        return None if self.adapter is None else self.layer.lora_A[self.adapter].weight

    @property
    def B(self) -> Optional[torch.Tensor]:
        return None if self.adapter is None else self.layer.lora_B[self.adapter].weight


def _is_peft_lora_linear(layer: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a dense nn.Linear or of a 4-bit bitsandbytes Linear4bit."""
    try:
        from peft.tuners.lora import Linear as PeftLoraLinear
    except Exception:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(layer, PeftLoraLinear) or quant.is_peft_lora_4bit(layer)


def _is_bare_base(layer: nn.Module) -> bool:
    """A projection LoRA does not target: the base layer itself, without a PEFT wrapper."""
    return type(layer) is nn.Linear or quant.is_4bit(layer)


def _base_reason(base: nn.Module) -> Optional[str]:
    if type(base) is not nn.Linear:
        return quant.unsupported_reason(base)
    if base.weight.dtype not in _FLOAT_DTYPES or hasattr(base.weight, "quant_state"):
        return f"base weight dtype {base.weight.dtype} is not bf16/fp16/fp32"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "base weight or bias is trainable (fused path assumes a frozen base)"
    return None


def lora_unsupported_reason(layer: nn.Module) -> Optional[str]:
    """None when `layer` can run on the fused path, else a short reason it keeps PEFT's path."""
    if _is_bare_base(layer):
        return _base_reason(layer)
    if not _is_peft_lora_linear(layer):
        # Other PEFT LoRA layers (over 8-bit bases, ...) and bare Linear subclasses (quantized
        # layers LoRA does not target): the base layer says best why they cannot fuse.
        get_base = getattr(layer, "get_base_layer", None)
        base = get_base() if callable(get_base) else layer
        reason = _base_reason(base) if base is not layer or isinstance(layer, nn.Linear) else None
        return reason or f"{type(layer).__module__}.{type(layer).__name__} is not a PEFT lora.Linear"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out layers are not supported"
    active = list(layer.active_adapters)
    if len(active) != 1:
        return f"{len(active)} active adapters (the fused path supports one)"
    name = active[0]
    if name not in layer.lora_A:
        return f"adapter '{name}' has no LoRA weights on this layer"
    if len([k for k in layer.lora_A.keys()]) > 1:
        return "several adapters are loaded on this layer"
    if layer.merged:
        return "adapter is merged into the base weight"
    if getattr(layer, "lora_variant", {}).get(name) is not None or getattr(layer, "use_dora", {}).get(name):
        return "DoRA / LoRA variants are not supported"
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0:
        return f"lora dropout {dropout.p} > 0"
    lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
    if type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear:
        return "LoRA A/B are not nn.Linear"
    if lora_A.bias is not None or lora_B.bias is not None or getattr(layer, "lora_bias", {}).get(name):
        return "LoRA bias is not supported"
    if lora_A.weight.dtype not in _FLOAT_DTYPES or lora_B.weight.dtype not in _FLOAT_DTYPES:
        return "LoRA weights are not floating point"
    scale = layer.scaling[name]
    if not isinstance(scale, (int, float)):
        return "per-token or tensor LoRA scaling is not supported"
    return _base_reason(layer.get_base_layer())


def lora_parts(layer: nn.Module) -> LoRAParts:
    """Split a supported projection (see `lora_unsupported_reason`) into base + adapter."""
    reason = lora_unsupported_reason(layer)
    if reason is not None:
        raise ValueError(f"layer not supported by the fused LoRA path: {reason}")
    if _is_bare_base(layer):
        return LoRAParts(layer, layer, None, 0.0)
    name = layer.active_adapters[0]
    return LoRAParts(layer, layer.get_base_layer(), name, float(layer.scaling[name]))


def runtime_ok(parts: Sequence[LoRAParts], x: torch.Tensor) -> bool:
    """Per-call check that the state seen when patching still holds (cheap attribute reads).

    Adapters can be disabled (PEFT's `disable_adapter()`), merged or switched after patching,
    and autocast changes compute dtypes; in those cases the caller takes the stock path. The
    activations must be in the dtype the stock base computes in (a 4-bit base's compute dtype),
    so both paths round alike.
    """
    if torch.is_autocast_enabled(x.device.type):
        return False
    for p in parts:
        if base_dtype(p.base) != x.dtype:
            return False
        if p.adapter is not None:
            layer = p.layer
            if layer.disable_adapters or layer.merged or layer.active_adapters != [p.adapter]:
                return False
    return True


# -- adapter generation: what invalidates the cached adapter weights ----------------------------

# One counter for the whole process. Every optimizer step advances it (a global post-step hook:
# any optimizer, fused or not, ours or a caller's), and so does every load of adapter weights
# through the engine (`adapters_changed`). Code that writes adapter weights some other way
# without bumping `_version` (through `.data`, say) must call `adapters_changed()` itself.
_GENERATION = [0]


def adapters_changed() -> None:
    """Mark every cached adapter weight stale (the next forward rebuilds it)."""
    _GENERATION[0] += 1


def adapter_generation() -> int:
    return _GENERATION[0]


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _GENERATION[0] += 1


register_optimizer_step_post_hook(_after_optimizer_step)


# -- a planned group of projections and its per-step weight cache ------------------------------


class LoRAGroup:
    """Projections sharing one input, resolved once (at patch time) into plain attributes.

    Besides saving the per-call attribute chains of `LoRAParts`, the group caches what the
    Functions derive from the adapter weights: the A matrices stacked and cast to the compute
    dtype, and each B cast and pre-multiplied by its scale. Adapters change only at optimizer
    steps, while the Functions read them in every forward, recompute and backward, so building
    these once per step removes most of the small cast/cat kernels (and their launch cost) from
    the step.

    The cache is keyed by the adapter generation (`adapter_generation`), which every optimizer
    step and every load of adapter weights advances, and by each weight's identity, `_version`
    and data pointer (in-place `copy_` and `.data =` swaps). `_version` alone is not enough:
    a fused optimizer (AdamW(fused=True), the engine's choice on CUDA) updates parameters
    without bumping it, and a cache keyed on it served the step-0 adapters for a whole run.
    Entries are rebuilt, never updated in place, so a Function's saved copy stays consistent
    with its forward.
    """

    __slots__ = ("parts", "bases", "scales", "ranks", "_lora", "_key", "_value")

    def __init__(self, parts: Sequence[LoRAParts]):
        self.parts = tuple(parts)
        self.bases = tuple(p.base for p in self.parts)
        self.scales = tuple(p.scale for p in self.parts)
        # (lora_A module, lora_B module) per projection, None where it has no LoRA; `.weight`
        # is read per call, so a replaced Parameter is picked up.
        self._lora = tuple(
            None if p.adapter is None else (p.layer.lora_A[p.adapter], p.layer.lora_B[p.adapter])
            for p in self.parts
        )
        self.ranks = tuple(0 if m is None else m[0].weight.shape[0] for m in self._lora)
        self._key = None
        self._value = None

    def ab(self) -> list[Optional[torch.Tensor]]:
        """[A_1, B_1, A_2, B_2, ...] (the trainable inputs of the Functions), None without LoRA."""
        out: list[Optional[torch.Tensor]] = []
        for m in self._lora:
            if m is None:
                out += [None, None]
            else:
                out += [m[0].weight, m[1].weight]
        return out

    def runtime_ok(self, x: torch.Tensor) -> bool:
        return runtime_ok(self.parts, x)

    def weights(self, ab: Sequence[Optional[torch.Tensor]], dtype: torch.dtype):
        """(A_all [R, in], (s_1 B_1, s_2 B_2, ...)) in `dtype`, built once per weight update.

        A_all is None when no projection has LoRA; B entries are None where one has none.
        """
        key = [dtype, _GENERATION[0]]
        for t in ab:
            if t is not None:
                key += (id(t), t._version, t.data_ptr())
        key = tuple(key)
        if key != self._key:
            self._value = _build_weights(ab, self.scales, dtype)
            # Holding the tensors (in _value's sources) keeps their ids from being reused.
            self._key = key
        return self._value


def _build_weights(ab, scales, dtype):
    with torch.no_grad():
        As = [ab[i].to(dtype) for i in range(0, len(ab), 2) if ab[i] is not None]
        a_all = None if not As else (As[0] if len(As) == 1 else torch.cat(As, 0))
        if a_all is not None and a_all is ab[0]:
            # The parameter itself (same dtype, single A): detach so no cached object aliases
            # the autograd leaf.
            a_all = a_all.detach()
        bs = []
        for i in range(len(scales)):
            B = ab[2 * i + 1]
            if B is None:
                bs.append(None)
                continue
            s = scales[i]
            # Folding the scale into B here removes a multiply from every backward (dy B) and
            # keeps the forward's addmm at alpha=1; numerics differ by one rounding of s*B.
            if B.dtype == dtype:
                bs.append(B.detach() * s if s != 1 else B.detach())
            elif s == 1:
                bs.append(B.to(dtype))
            else:
                bs.append(torch.mul(B, s).to(dtype))
    return a_all, tuple(bs), tuple(t for t in ab if t is not None)


def as_group(parts) -> LoRAGroup:
    return parts if isinstance(parts, LoRAGroup) else LoRAGroup(parts)


# -- the math shared by the Functions (plain tensors, no autograd) ----------------------------


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, s: float, dtype: torch.dtype) -> torch.Tensor:
    """s * (a @ b) in `dtype`: the scale rides on the GEMM's alpha (beta=0 ignores the
    uninitialized buffer), so the only extra kernel is the cast when `dtype` differs."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    out.addmm_(a, b, beta=0, alpha=s)
    return out if out.dtype == dtype else out.to(dtype)


def _group_forward(x, group: LoRAGroup, w):
    """Outputs of projections sharing input x [N, in], and xa = x @ [A_1; A_2; ...]^T [N, R]."""
    a_all, bs, _ = w
    xa = None if a_all is None else torch.mm(x, a_all.t())
    ys, col = [], 0
    for base, B, r in zip(group.bases, bs, group.ranks):
        if B is None:
            ys.append(base_linear(x, base))
            continue
        ys.append(lora_linear_out(x, xa[:, col : col + r], B, base))
        col += r
    return ys, xa


def _group_backward(dys, x, xa, group: LoRAGroup, w, ab, need_dx: bool, need_ab: Sequence[bool]):
    """Gradients for a projection group: (dx or None, [dA_1, dB_1, ...] with None where unneeded)."""
    dtype = x.dtype
    a_all, bs, _ = w
    dx = None
    g_parts = []  # dy_i (s_i B_i), stacked to [N, R] to pair with the stacked A
    dab: list[Optional[torch.Tensor]] = [None] * len(ab)
    col = 0
    for i, (B, r) in enumerate(zip(bs, group.ranks)):
        if B is None:
            continue
        dy = dys[i]
        if need_ab[2 * i + 1]:
            dab[2 * i + 1] = _scaled_mm(dy.t(), xa[:, col : col + r], group.scales[i], ab[2 * i + 1].dtype)
        g_parts.append(torch.mm(dy, B))
        col += r
    g = None
    if g_parts:
        g = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, 1)
    if need_dx:
        # The rank-R term first; every base GEMM then adds onto dx (see lora_linear_out).
        dx = None if g is None else torch.mm(g, a_all)
        for dy, base in zip(dys, group.bases):
            wt = base_weight(base, dtype)
            dx = torch.mm(dy, wt) if dx is None else dx.addmm_(dy, wt)
            del wt  # a dequantized 4-bit weight goes before the next one is made
    if g is not None:
        if any(need_ab[0::2]):
            da_all = torch.mm(g.t(), x)  # [R, in]: every dA of the group in one matmul
            row = 0
            for i, r in enumerate(group.ranks):
                if not r:
                    continue
                if need_ab[2 * i]:
                    dab[2 * i] = da_all[row : row + r].to(ab[2 * i].dtype)
                row += r
    return dx, dab


# -- autograd Functions ------------------------------------------------------------------------


class LoRALinears(torch.autograd.Function):
    """Projections sharing one 2-D input: forward(x, group, A_1, B_1, ...) -> (y_1, ...)."""

    @staticmethod
    def forward(ctx, x, group, *ab):
        COUNTERS["lora_linears"] += 1
        w = group.weights(ab, x.dtype)
        ys, xa = _group_forward(x, group, w)
        # The cached low-precision weights are kept on ctx (they are not autograd inputs and
        # are never modified in place); only the activations go through save_for_backward,
        # which is what checkpointing recomputes.
        ctx.group, ctx.w = group, w
        ctx.ab_dtypes = [None if t is None else t.dtype for t in ab]
        ctx.save_for_backward(x, xa)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, xa = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dab = _group_backward(dys, x, xa, ctx.group, ctx.w, _DtypeOnly.wrap(ctx.ab_dtypes), need[0], need[2:])
        return (dx, None, *dab)


# The MLP's [tokens, intermediate] tensors are its largest: gate and up are saved, and the
# activation output h and its gradient dh would double that at the peak. Above this size h and
# dh are made and used a slice of rows at a time (never whole); the slices stay tall enough
# for full-speed matmuls. W3 (16k tokens x 12,288) runs in 3 slices, W1 (x 3,072) in 2.
MLP_SLICE_BYTES = 64 * 2**20


def _row_slices(n: int, inter: int, element_size: int) -> list[tuple[int, int]]:
    """Row ranges covering n rows with at most MLP_SLICE_BYTES of [rows, inter] each."""
    rows = max(256, MLP_SLICE_BYTES // max(1, inter * element_size))
    if rows >= n:
        return [(0, n)]
    rows = max(256, (rows // 64) * 64)
    return [(s, min(s + rows, n)) for s in range(0, n, rows)]


def _down_forward(gate, up, act, down: LoRAGroup, w_out):
    """y = down(act(gate, up)) and ha = h @ A_down^T, making h one row slice at a time."""
    a_all, (B,), _ = w_out
    base = down.bases[0]
    n = gate.shape[0]
    slices = _row_slices(n, gate.shape[1], gate.element_size())
    if len(slices) == 1:
        h = act.forward_raw(gate, up)
        (y,), ha = _group_forward(h, down, w_out)
        return y, ha
    W = base_weight(base, gate.dtype)  # one dequantization (4-bit) for all slices
    y = torch.empty((n, W.shape[0]), dtype=gate.dtype, device=gate.device)
    ha = None if a_all is None else torch.empty((n, a_all.shape[0]), dtype=gate.dtype, device=gate.device)
    for s, e in slices:
        h = act.forward_raw(gate[s:e], up[s:e])
        if ha is None:
            torch.mm(h, W.t(), out=y[s:e])
        else:  # the rank-r term first, the base GEMM adds onto it (see lora_linear_out)
            torch.mm(h, a_all.t(), out=ha[s:e])
            torch.mm(ha[s:e], B.t(), out=y[s:e])
            y[s:e].addmm_(h, W.t())
        del h
    if base.bias is not None:
        y += base.bias.to(y.dtype)
    return y, ha


def _down_backward(dy, gate, up, ha, act, down: LoRAGroup, w_out, ab, need_ab):
    """Gradients of the down projection and the activation, one row slice at a time.

    Overwrites gate and up with d_gate and d_up (they are the Function's own saved tensors);
    returns [dA_down, dB_down] (None where not needed). h and dh exist for one slice at a time.
    """
    a_all, (B,), _ = w_out
    base = down.bases[0]
    dtype = gate.dtype
    n = gate.shape[0]
    slices = _row_slices(n, gate.shape[1], gate.element_size())
    W = base_weight(base, dtype)
    dab: list[Optional[torch.Tensor]] = [None, None]
    g = None
    if B is not None:
        if need_ab[1]:
            dab[1] = _scaled_mm(dy.t(), ha, down.scales[0], ab[1].dtype)
        g = torch.mm(dy, B)  # dy (s B): [N, r]
    da = None
    for s, e in slices:
        h, act_grad = act.backward_raw(gate[s:e], up[s:e])
        if g is not None and need_ab[0]:
            part = torch.mm(g[s:e].t(), h)  # [r, inter]
            # Slices are summed in fp32 (a single slice is used as the GEMM returns it).
            da = part if da is None else (da.float() if da.dtype != torch.float32 else da).add_(part)
        del h
        if g is None:
            dh = torch.mm(dy[s:e], W)
        else:  # the rank-r term first, the base GEMM adds onto it (see lora_linear_out)
            dh = torch.mm(g[s:e], a_all).addmm_(dy[s:e], W)
        dgate, dup = act_grad(dh)
        del dh
        if dgate.data_ptr() != gate[s:e].data_ptr():  # the torch fallback returns new tensors
            gate[s:e].copy_(dgate)
            up[s:e].copy_(dup)
        del dgate, dup
    if da is not None:
        dab[0] = da.to(ab[0].dtype)
    return dab


class LoRAMLP(torch.autograd.Function):
    """down(act(gate(x), up(x))) with LoRA on each: forward(x, gate_up, down, act, A/B x3)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, act, *ab):
        COUNTERS["lora_mlp"] += 1
        w_in = gate_up.weights(ab[:4], x.dtype)
        w_out = down.weights(ab[4:], x.dtype)
        (gate, up), xa = _group_forward(x, gate_up, w_in)
        y, ha = _down_forward(gate, up, act, down, w_out)
        ctx.groups, ctx.w, ctx.act = (gate_up, down), (w_in, w_out), act
        ctx.ab_dtypes = [None if t is None else t.dtype for t in ab]
        # h ([N, inter]) is not saved: one elementwise pass rebuilds it in backward.
        ctx.save_for_backward(x, xa, gate, up, ha)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, xa, gate, up, ha = ctx.saved_tensors
        need = ctx.needs_input_grad
        gate_up, down = ctx.groups
        w_in, w_out = ctx.w
        need_ab = need[4:]
        ab = _DtypeOnly.wrap(ctx.ab_dtypes)
        # gate/up now hold d_gate/d_up (they are ours and used by nothing else).
        dab_down = _down_backward(dy, gate, up, ha, ctx.act, down, w_out, ab[4:], need_ab[4:])
        dx, dab_in = _group_backward((gate, up), x, xa, gate_up, w_in, ab[:4], need[0], need_ab[:4])
        return (dx, None, None, None, *dab_in, *dab_down)


class _DtypeOnly:
    """Stands in for an adapter weight in backward, where only its dtype is read."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype

    @staticmethod
    def wrap(dtypes):
        return [None if d is None else _DtypeOnly(d) for d in dtypes]


# -- gated activations ---------------------------------------------------------------------------


class GatedAct:
    """act(gate) * up for the MLP, with the explicit forward/backward LoRAMLP needs.

    kind: "silu" (SwiGLU), "gelu" (GeGLU, erf) or "gelu_tanh" (GeGLU, tanh form).
    impl: "torch" (plain torch ops, bit-identical to transformers' MLP), "kernels"
    (engine.kernels.activations: Triton on CUDA, its torch reference elsewhere) or "triton"
    (the Triton kernel on any device; CPU needs TRITON_INTERPRET=1, used by tests).
    """

    KINDS = ("silu", "gelu", "gelu_tanh")

    def __init__(self, kind: str, impl: str = "torch"):
        if kind not in self.KINDS:
            raise ValueError(f"unknown gated activation {kind!r}; expected one of {self.KINDS}")
        if impl not in ("torch", "kernels", "triton"):
            raise ValueError(f"unknown activation impl {impl!r}")
        self.kind, self.impl = kind, impl

    def __repr__(self) -> str:
        return f"GatedAct({self.kind!r}, impl={self.impl!r})"

    def _raw_triton(self, t: torch.Tensor) -> bool:
        return self.impl == "triton" or (self.impl == "kernels" and t.is_cuda)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Autograd-capable act(gate) * up."""
        if self.impl == "torch":
            if self.kind == "silu":
                return torch_swiglu(gate, up)
            return torch_geglu(gate, up, "tanh" if self.kind == "gelu_tanh" else "none")
        from engine.kernels import activations as K

        approximate = "tanh" if self.kind == "gelu_tanh" else "none"
        if self.impl == "triton":
            if self.kind == "silu":
                return K.swiglu_triton(gate, up)
            return K.geglu_triton(gate, up, approximate)
        if self.kind == "silu":
            return K.swiglu(gate, up)
        return K.geglu(gate, up, approximate)

    def forward_raw(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up without autograd (inside a Function's forward)."""
        if self._raw_triton(gate):
            from engine.kernels.activations import gated_act_forward

            return gated_act_forward(gate, up, self.kind)
        with torch.no_grad():
            return self(gate, up)

    def backward_raw(self, gate: torch.Tensor, up: torch.Tensor):
        """(h, grad) where grad(dh) -> (d_gate, d_up); grad may overwrite gate and up."""
        if self._raw_triton(gate):
            from engine.kernels.activations import gated_act_backward, gated_act_forward

            h = gated_act_forward(gate, up, self.kind)
            return h, lambda dh: gated_act_backward(dh, gate, up, self.kind, inplace=True)
        # Elsewhere let autograd differentiate the same function the forward used.
        with torch.enable_grad():
            g_ = gate.detach().requires_grad_()
            u_ = up.detach().requires_grad_()
            h = self(g_, u_)
        return h.detach(), lambda dh: torch.autograd.grad(h, (g_, u_), dh)


# -- entry points --------------------------------------------------------------------------------


def lora_linears(x: torch.Tensor, parts) -> tuple[torch.Tensor, ...]:
    """The projections in `parts` applied to x [..., in] (q/k/v together, or o alone).

    `parts` is a sequence of `LoRAParts` or, on hot paths, a `LoRAGroup` planned once (which
    also caches the adapter weights in the compute dtype across calls).
    """
    group = as_group(parts)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ys = LoRALinears.apply(x2, group, *group.ab())
    # Reshape outside the Function: a view returned from inside it could not be modified in
    # place later (the RoPE kernel rotates q/k in place).
    return tuple(y.view(*lead, y.shape[-1]) for y in ys)


def lora_mlp(x: torch.Tensor, gate, up=None, down=None, act: "GatedAct" = None) -> torch.Tensor:
    """down(act(gate(x), up(x))) for x [..., hidden].

    Either lora_mlp(x, gate_parts, up_parts, down_parts, act) or, planned once,
    lora_mlp(x, gate_up_group, down_group, act=act) with `LoRAGroup`s.
    """
    if isinstance(gate, LoRAGroup):
        gate_up, down_g = gate, up
    else:
        gate_up, down_g = LoRAGroup((gate, up)), LoRAGroup((down,))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = LoRAMLP.apply(x2, gate_up, down_g, act, *gate_up.ab(), *down_g.ab())
    return y.view(*lead, y.shape[-1])


# -- torch reference activations (used when the kernels are off) ------------------------------


def torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def torch_geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up
