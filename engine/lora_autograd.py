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
4-bit base would be dequantized later.

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

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- base layer access: the one place a quantized base would plug in ---------------------------


def base_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base weight [out, in] as a dense tensor in `dtype`.

    A 4-bit (NF4) base would dequantize here; until then `lora_unsupported_reason` keeps
    quantized layers on PEFT's path, so only dense float weights reach this function.
    """
    w = layer.weight
    return w if w.dtype == dtype else w.to(dtype)


def base_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """x @ W^T + b with the frozen base layer (no autograd: called inside Functions)."""
    bias = layer.bias
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, base_weight(layer, x.dtype), bias)


# -- what a projection is made of --------------------------------------------------------------


@dataclass(frozen=True)
class LoRAParts:
    """One projection: its frozen base and, when wrapped by PEFT, the active adapter's A/B."""

    layer: nn.Module  # the module the model calls (PEFT wrapper or plain nn.Linear)
    base: nn.Module  # the frozen nn.Linear
    adapter: Optional[str]  # None: no LoRA on this projection
    scale: float = 0.0

    @property
    def A(self) -> Optional[torch.Tensor]:
        return None if self.adapter is None else self.layer.lora_A[self.adapter].weight

    @property
    def B(self) -> Optional[torch.Tensor]:
        return None if self.adapter is None else self.layer.lora_B[self.adapter].weight


def _is_peft_lora_linear(layer: nn.Module) -> bool:
    try:
        from peft.tuners.lora import Linear as PeftLoraLinear
    except Exception:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(layer, PeftLoraLinear)


def _dense_base_reason(base: nn.Module) -> Optional[str]:
    if type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not a dense nn.Linear (quantized bases keep PEFT's path for now)"
    if base.weight.dtype not in _FLOAT_DTYPES or hasattr(base.weight, "quant_state"):
        return f"base weight dtype {base.weight.dtype} is not bf16/fp16/fp32"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "base weight or bias is trainable (fused path assumes a frozen base)"
    return None


def lora_unsupported_reason(layer: nn.Module) -> Optional[str]:
    """None when `layer` can run on the fused path, else a short reason it keeps PEFT's path."""
    if type(layer) is nn.Linear:  # a projection LoRA does not target: base only
        return _dense_base_reason(layer)
    if not _is_peft_lora_linear(layer):
        return f"{type(layer).__module__}.{type(layer).__name__} is not a PEFT lora.Linear"
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
    return _dense_base_reason(layer.get_base_layer())


def lora_parts(layer: nn.Module) -> LoRAParts:
    """Split a supported projection (see `lora_unsupported_reason`) into base + adapter."""
    reason = lora_unsupported_reason(layer)
    if reason is not None:
        raise ValueError(f"layer not supported by the fused LoRA path: {reason}")
    if type(layer) is nn.Linear:
        return LoRAParts(layer, layer, None, 0.0)
    name = layer.active_adapters[0]
    return LoRAParts(layer, layer.get_base_layer(), name, float(layer.scaling[name]))


def runtime_ok(parts: Sequence[LoRAParts], x: torch.Tensor) -> bool:
    """Per-call check that the state seen when patching still holds (cheap attribute reads).

    Adapters can be disabled (PEFT's `disable_adapter()`), merged or switched after patching,
    and autocast changes compute dtypes; in those cases the caller takes the stock path.
    """
    if torch.is_autocast_enabled(x.device.type):
        return False
    for p in parts:
        if p.base.weight.dtype != x.dtype:
            return False
        if p.adapter is not None:
            layer = p.layer
            if layer.disable_adapters or layer.merged or layer.active_adapters != [p.adapter]:
                return False
    return True


# -- the math shared by the Functions (plain tensors, no autograd) ----------------------------


def _ab_flat(parts: Sequence[LoRAParts]) -> list[Optional[torch.Tensor]]:
    out: list[Optional[torch.Tensor]] = []
    for p in parts:
        out += [p.A, p.B]
    return out


def _stacked_A(ab: Sequence[Optional[torch.Tensor]], dtype) -> Optional[torch.Tensor]:
    As = [ab[i].to(dtype) for i in range(0, len(ab), 2) if ab[i] is not None]
    if not As:
        return None
    return As[0] if len(As) == 1 else torch.cat(As, 0)


def _group_forward(x, bases, scales, ab):
    """Outputs of projections sharing input x [N, in], and xa = x @ [A_1; A_2; ...]^T [N, R]."""
    a_all = _stacked_A(ab, x.dtype)
    xa = None if a_all is None else x @ a_all.t()
    ys, col = [], 0
    for i, base in enumerate(bases):
        y = base_linear(x, base)
        A, B = ab[2 * i], ab[2 * i + 1]
        if A is not None:
            r = A.shape[0]
            y.addmm_(xa[:, col : col + r], B.to(x.dtype).t(), alpha=scales[i])
            col += r
        ys.append(y)
    return ys, xa


def _group_backward(dys, x, xa, bases, scales, ab, need_dx: bool, need_ab: Sequence[bool]):
    """Gradients for a projection group: (dx or None, [dA_1, dB_1, ...] with None where unneeded)."""
    dtype = x.dtype
    dx = None
    g_parts = []  # s_i * dy_i B_i, stacked to [N, R] to pair with the stacked A
    dab: list[Optional[torch.Tensor]] = [None] * len(ab)
    col = 0
    for i, base in enumerate(bases):
        dy = dys[i]
        if need_dx:
            w = base_weight(base, dtype)
            dx = dy @ w if dx is None else dx.addmm_(dy, w)
        A, B = ab[2 * i], ab[2 * i + 1]
        if A is None:
            continue
        r = A.shape[0]
        if need_ab[2 * i + 1]:
            dab[2 * i + 1] = (dy.t() @ xa[:, col : col + r]).mul_(scales[i]).to(B.dtype)
        g_parts.append((dy @ B.to(dtype)).mul_(scales[i]))
        col += r
    if g_parts:
        g = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, 1)
        if need_dx:
            dx.addmm_(g, _stacked_A(ab, dtype))
        if any(need_ab[0::2]):
            da_all = g.t() @ x  # [R, in]: every dA of the group in one matmul
            row = 0
            for i in range(len(bases)):
                A = ab[2 * i]
                if A is None:
                    continue
                r = A.shape[0]
                if need_ab[2 * i]:
                    dab[2 * i] = da_all[row : row + r].to(A.dtype)
                row += r
    return dx, dab


# -- autograd Functions ------------------------------------------------------------------------


class LoRALinears(torch.autograd.Function):
    """Projections sharing one 2-D input: forward(x, bases, scales, A_1, B_1, ...) -> (y_1, ...)."""

    @staticmethod
    def forward(ctx, x, bases, scales, *ab):
        ys, xa = _group_forward(x, bases, scales, ab)
        ctx.bases, ctx.scales = bases, scales
        ctx.save_for_backward(x, xa, *ab)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, xa, *ab = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dab = _group_backward(dys, x, xa, ctx.bases, ctx.scales, ab, need[0], need[3:])
        return (dx, None, None, *dab)


class LoRAMLP(torch.autograd.Function):
    """down(act(gate(x), up(x))) with LoRA on each: forward(x, bases[3], scales[3], act, A/B x3)."""

    @staticmethod
    def forward(ctx, x, bases, scales, act, *ab):
        (gate, up), xa = _group_forward(x, bases[:2], scales[:2], ab[:4])
        h = act.forward_raw(gate, up)
        (y,), ha = _group_forward(h, bases[2:], scales[2:], ab[4:])
        ctx.bases, ctx.scales, ctx.act = bases, scales, act
        # h ([N, inter]) is not saved: one elementwise pass rebuilds it in backward.
        ctx.save_for_backward(x, xa, gate, up, ha, *ab)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, xa, gate, up, ha, *ab = ctx.saved_tensors
        need = ctx.needs_input_grad
        bases, scales = ctx.bases, ctx.scales
        need_ab = need[4:]
        h, act_grad = ctx.act.backward_raw(gate, up)
        dh, dab_down = _group_backward((dy,), h, ha, bases[2:], scales[2:], ab[4:], True, need_ab[4:])
        del h
        # May overwrite gate/up with their gradients (they are ours and used by nothing else).
        dgate, dup = act_grad(dh)
        del dh
        dx, dab_in = _group_backward(
            (dgate, dup), x, xa, bases[:2], scales[:2], ab[:4], need[0], need_ab[:4]
        )
        return (dx, None, None, None, *dab_in, *dab_down)


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


def lora_linears(x: torch.Tensor, parts: Sequence[LoRAParts]) -> tuple[torch.Tensor, ...]:
    """The projections in `parts` applied to x [..., in] (q/k/v together, or o alone)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ys = LoRALinears.apply(
        x2, tuple(p.base for p in parts), tuple(p.scale for p in parts), *_ab_flat(parts)
    )
    # Reshape outside the Function: a view returned from inside it could not be modified in
    # place later (the RoPE kernel rotates q/k in place).
    return tuple(y.view(*lead, y.shape[-1]) for y in ys)


def lora_mlp(
    x: torch.Tensor, gate: LoRAParts, up: LoRAParts, down: LoRAParts, act: "GatedAct"
) -> torch.Tensor:
    """down(act(gate(x), up(x))) for x [..., hidden]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    parts = (gate, up, down)
    y = LoRAMLP.apply(
        x2, tuple(p.base for p in parts), tuple(p.scale for p in parts), act, *_ab_flat(parts)
    )
    return y.view(*lead, y.shape[-1])


# -- torch reference activations (used when the kernels are off) ------------------------------


def torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def torch_geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up
