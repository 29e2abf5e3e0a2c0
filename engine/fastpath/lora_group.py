"""What a LoRA projection is made of, and the per-step cache of its adapter weights.

The fused LoRA Functions (engine.fastpath.lora) work on plain tensors; this module gives them:

- base access: `base_weight` / `base_dtype` / `base_linear` / `lora_linear_out`, and
  `base_operand` / `base_mm` (an NF4 base read by the fused NF4 matmul, never dequantized whole),
  the single place where a 4-bit (QLoRA) base plugs in (engine.fastpath.quant);
- `lora_unsupported_reason` / `lora_parts` / `runtime_ok`: whether a projection can take the
  fused path (at patch time, then per call), and its split into a frozen base and the active
  adapter's A/B;
- the adapter generation (`AdapterClock`, one per model: `adapter_clock`, and `watch_optimizer`,
  the hooks of the optimizer that trains that model): what invalidates cached adapter weights
  where their `_version` cannot;
- `LoRAGroup` (and `as_group`): projections sharing one input, resolved once, with the adapter
  weights cast, stacked and scaled once per weight update instead of in every call.

Light on purpose (torch, engine.counters and engine.fastpath.quant only): the optimizer code imports
`watch_optimizer` from here.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.counters import count
from engine.fastpath import quant

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- base layer access: the one place a quantized base plugs in ---------------------------------


# {id(4-bit layer): (dtype, its dense weight)} inside `dense_4bit_once` (None outside any).
_DENSE: ContextVar[Optional[dict]] = ContextVar("dense_4bit", default=None)


def base_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base weight [out, in] as a dense tensor in `dtype`.

    A 4-bit base is dequantized into a fresh tensor: callers use it for one matmul and drop it
    (it is never saved for backward), so one layer's dense weight exists at a time; inside
    `dense_4bit_once` the scope's one copy is handed out instead.
    """
    if quant.is_4bit(layer):
        held = (_DENSE.get() or {}).get(id(layer))
        if held is not None and held[0] == dtype:
            return held[1]
        return quant.dequantize(layer, dtype)
    w = layer.weight
    return w if w.dtype == dtype else w.to(dtype)


@contextmanager
def dense_4bit_once(layers: Sequence[nn.Module], dtype: torch.dtype) -> Iterator[None]:
    """Inside, each 4-bit base of `layers` is dequantized once and that copy serves every product
    (for a loop of row tiles that would otherwise decode the weight per tile); the copies are
    dropped on leaving. 16-bit bases are unaffected. Scopes do not nest (the inner one wins)."""
    held = {id(layer): (dtype, quant.dequantize(layer, dtype)) for layer in layers if quant.is_4bit(layer)}
    token = _DENSE.set(held)
    try:
        yield
    finally:
        _DENSE.reset(token)
        held.clear()


def base_dtype(layer: nn.Module) -> Optional[torch.dtype]:
    """The activation dtype the stock base layer computes in (None: not usable right now)."""
    if quant.is_4bit(layer):
        return quant.compute_dtype(layer)
    return layer.weight.dtype


def _bias(layer: nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    bias = layer.bias
    return bias if bias is None or bias.dtype == dtype else bias.to(dtype)


def base_operand(layer: nn.Module, a: torch.Tensor, transpose: bool = True, nf4: str = "auto"):
    """What `base_mm` multiplies `a` with: the packed weight of an NF4 base when the fused NF4
    matmul runs it (engine.fastpath.quant.nf4_operand: `nf4` "auto" on CUDA, "triton" on any
    device, "off" never), else the dense weight (`base_weight`)."""
    if quant.is_4bit(layer):
        w = quant.nf4_operand(layer, a, transpose, nf4)
        if w is not None:
            return w
    return base_weight(layer, a.dtype)


def base_mm(a: torch.Tensor, w, transpose: bool = True, out=None, accumulate: bool = False) -> torch.Tensor:
    """a @ W^T (transpose) or a @ W for a `base_operand`; into `out`, added onto it when `accumulate`."""
    if quant.is_nf4_operand(w):
        return quant.nf4_mm(a, w, transpose, out, accumulate)
    b = w.t() if transpose else w
    if out is None:
        return torch.mm(a, b)
    return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)


def base_linear(x: torch.Tensor, layer: nn.Module, nf4: str = "auto") -> torch.Tensor:
    """x @ W^T + b with the frozen base layer (no autograd: called inside Functions)."""
    w = base_operand(layer, x, True, nf4)
    bias = _bias(layer, x.dtype)
    if not quant.is_nf4_operand(w):
        return F.linear(x, w, bias)
    if bias is None:
        return base_mm(x, w)
    return base_mm(x, w, out=bias.expand(x.shape[0], -1).contiguous(), accumulate=True)


# Order of the two matmuls of a LoRA projection, y = x W^T + (x A^T)(s B)^T, and of its input
# gradient, dx = dy W + (dy s B) A: the rank-r product is made first and the base GEMM adds onto
# it (beta=1). The other order makes the big output, then reads and writes all of it again to
# add a K=r product, a pass bound by memory (about a tenth of a 14B QLoRA step on the H200);
# this way the only extra traffic is the GEMM epilogue's read of C, which overlaps its math.


def lora_linear_out(
    x: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, layer: nn.Module, nf4: str = "auto"
) -> torch.Tensor:
    """x @ W^T + b + xa @ B^T (B already scaled)."""
    bias = _bias(layer, x.dtype)
    y = torch.mm(xa, B.t()) if bias is None else torch.addmm(bias, xa, B.t())
    return base_mm(x, base_operand(layer, x, True, nf4), out=y, accumulate=True)


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

    Adapters can be merged or switched after patching, and autocast changes compute dtypes; in
    those cases the caller takes the stock path. Adapters disabled (PEFT's `disable_adapter()`:
    the reference pass of DPO, KTO and GRPO) stay on the fused path with the LoRA term left out
    (`LoRAGroup.weights`), as long as the whole group is disabled. The activations must be in
    the dtype the stock base computes in (a 4-bit base's compute dtype), so both paths round alike.
    """
    if torch.is_autocast_enabled(x.device.type):
        return False
    disabled = set()
    for p in parts:
        if base_dtype(p.base) != x.dtype:
            return False
        if p.adapter is not None:
            layer = p.layer
            if layer.merged or layer.active_adapters != [p.adapter]:
                return False
            disabled.add(bool(layer.disable_adapters))
    return len(disabled) <= 1  # a group half on, half off is left to the stock path


# -- adapter generation: what invalidates the cached adapter weights ----------------------------

# The cache (LoRAGroup.weights) keys on each adapter weight's identity, `_version` and data
# pointer, which see every write through torch's in-place ops (a checkpoint's or a rollback's
# `copy_`). Two writes leave all three alone: a fused optimizer step (AdamW(fused=True), the
# engine's choice on CUDA) and FSDP2's gather of a shard into the unsharded weight (it preserves
# the version counter on purpose). Those need the generation, a number that belongs to the model
# whose adapters it describes (its `AdapterClock`), never to the process: two sessions in one
# process, a probe on another thread or a CUDA graph of one model never see another model's
# steps. Who advances it: the optimizer the engine trains that model with, and nothing else
# (`watch_optimizer`, hooked by engine.train.optim.make_optimizer): after each of its steps, and
# after each load of its state, which the engine does exactly where it writes the adapter weights
# back (a checkpoint's resume, a rollback to a snapshot). No caller advances it by hand. Loads
# into a fresh model (lora.init_adapter before the fast paths are set up, export, chat) have no
# cached copy to make stale.

_CLOCK = "_tunesmith_adapter_clock"  # where a model and each of its LoRA layers keep their clock


class AdapterClock:
    """The adapter generation of one model: advanced by its optimizer's steps and state loads."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0

    def advance(self, *_args) -> None:
        """Mark every cached copy of this model's adapter weights stale (hook signature: any args)."""
        self.generation += 1


def adapter_clock(model: nn.Module) -> AdapterClock:
    """`model`'s clock, made on first use and kept on the model and on each of its LoRA layers
    (where a LoRAGroup, which sees layers only, reads it)."""
    clock = model.__dict__.get(_CLOCK)
    if clock is None:
        clock = AdapterClock()
        model.__dict__[_CLOCK] = clock
    for module in model.modules():
        if "lora_A" in module._modules:  # PEFT's LoRA layers, over any base
            module.__dict__[_CLOCK] = clock
    return clock


def watch_optimizer(optimizer, model: nn.Module) -> AdapterClock:
    """Advance `model`'s adapter generation after every step of `optimizer` and every load of its
    state (and of no other optimizer); returns the clock."""
    clock = adapter_clock(model)
    optimizer.register_step_post_hook(clock.advance)
    optimizer.register_load_state_dict_post_hook(clock.advance)
    return clock


# -- a planned group of projections and its per-step weight cache ------------------------------


class LoRAGroup:
    """Projections sharing one input, resolved once (at patch time) into plain attributes.

    Besides saving the per-call attribute chains of `LoRAParts`, the group caches what the
    Functions derive from the adapter weights: the A matrices stacked and cast to the compute
    dtype, and each B cast and pre-multiplied by its scale. Adapters change only at optimizer
    steps, while the Functions read them in every forward, recompute and backward, so building
    these once per step removes most of the small cast/cat kernels (and their launch cost) from
    the step.

    The cache is keyed by the model's adapter generation (its `AdapterClock`, read from the
    group's first LoRA layer at each call, so a clock made after the group counts), which every
    step and every state load of the model's watched optimizer advances, and by each weight's
    identity, `_version` and data pointer (in-place `copy_` and `.data =` swaps). `_version`
    alone is not enough: a fused optimizer (AdamW(fused=True), the engine's choice on CUDA)
    updates parameters without bumping it, and a cache keyed on it served the step-0 adapters
    for a whole run.
    Entries are rebuilt, never updated in place, so a Function's saved copy stays consistent
    with its forward.
    """

    __slots__ = (
        "parts",
        "bases",
        "scales",
        "ranks",
        "nf4",
        "fold",
        "row_fold",
        "_lora",
        "_owner",
        "_key",
        "_value",
        "_stack",
    )

    def __init__(self, parts: Sequence[LoRAParts], nf4: str = "auto"):
        self.parts = tuple(parts)
        self.nf4 = nf4  # how NF4 bases are multiplied: see base_operand
        self.bases = tuple(p.base for p in self.parts)
        self.scales = tuple(p.scale for p in self.parts)
        # (lora_A module, lora_B module) per projection, None where it has no LoRA; `.weight`
        # is read per call, so a replaced Parameter is picked up.
        self._lora = tuple(
            None if p.adapter is None else (p.layer.lora_A[p.adapter], p.layer.lora_B[p.adapter]) for p in self.parts
        )
        self.ranks = tuple(0 if m is None else m[0].weight.shape[0] for m in self._lora)
        # The layer whose clock (adapter_clock) this group reads; None: no LoRA, nothing to cache.
        self._owner = next((p.layer for p in self.parts if p.adapter is not None), None)
        self._key = None
        self._value = None
        self._stack = (None, None)  # (the bases' data pointers, their stacked weight or None)
        # How engine.fastpath.lora_fold.fold_bases laid the bases out (a lora_fold.Fold), or None.
        self.fold = None
        # A single projection's weight with A's rows below it (lora_fold.fold_rows: a RowFold), or None.
        self.row_fold = None

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

    def stacked_weight(self) -> Optional[torch.Tensor]:
        """[W_1; W_2; ...] as one [sum of outs, in] tensor when `stack_bases` left the bases'
        weights back to back in one buffer (and nothing has moved them since), else None.

        Checked per call on the weights' data pointers: a model moved or cast after patching gets
        new, separate weights, and the group then multiplies them one by one as before.
        """
        if len(self.bases) < 2:
            return None
        ptrs = tuple(b.weight.data_ptr() for b in self.bases)
        if ptrs != self._stack[0]:
            self._stack = (ptrs, _stacked_view(self.bases))
        return self._stack[1]

    def weights(self, ab: Sequence[Optional[torch.Tensor]], dtype: torch.dtype):
        """(A_all [R, in], (s_1 B_1, s_2 B_2, ...)) in `dtype`, built once per weight update.

        A_all is None when no projection has LoRA; B entries are None where one has none.
        With the adapters disabled (the reference pass) every entry is None: the base alone,
        and the cached adapter weights stay for the next pass with them on.
        """
        if any(m is not None and p.layer.disable_adapters for m, p in zip(self._lora, self.parts)):
            return None, (None,) * len(self.parts), ()
        if _UNCACHED:  # inside a CUDA graph's capture: built in the graph, read by it only
            count("lora_cache_builds")
            value = _build_weights(ab, self.scales, dtype)
            self._write_folds(value)
            return value
        clock = None if self._owner is None else self._owner.__dict__.get(_CLOCK)
        key = [dtype, clock, 0 if clock is None else clock.generation]
        for t in ab:
            if t is not None:
                key += (id(t), t._version, t.data_ptr())
        key = tuple(key)
        if key != self._key:
            count("lora_cache_builds")
            self._value = _build_weights(ab, self.scales, dtype)
            self._write_folds(self._value)
            # Holding the tensors (in _value's sources) keeps their ids from being reused.
            self._key = key
        return self._value

    def _write_folds(self, value) -> None:
        """The folded bases' spare columns carry s*B, a row-folded base's spare rows A (lora_fold)."""
        if self.fold is not None:
            self.fold.write_tails(self.bases, value[1])
        if self.row_fold is not None:
            self.row_fold.write_rows(self.bases[0], value[0])


# True while a CUDA graph captures a micro-batch (engine.train.step_graph): each forward, recompute
# and backward then builds its cast adapter weights inside the graph, so every replay reads the
# adapters the optimizer left. A copy cached outside the capture would be read by every later
# replay, one optimizer step stale. A process-wide flag: capture holds the process's GPU work (the
# backward's worker thread included) until it ends.
_UNCACHED = False


@contextmanager
def uncached() -> Iterator[None]:
    """Within the block, LoRAGroup.weights builds fresh each call and caches nothing."""
    global _UNCACHED
    _UNCACHED = True
    try:
        yield
    finally:
        _UNCACHED = False


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


# -- frozen bases that share an input, stored back to back -------------------------------------

# Projections that read the same input (gate and up; q, k and v) are separate GEMMs in the stock
# model, each with its own weight. With the weights in one buffer, [W_gate; W_up] is one operand:
# the forward is one GEMM with twice the columns, and the input gradient dy_gate W_gate + dy_up
# W_up is one GEMM with twice the depth when the two gradients lie side by side (the gated
# activation's backward writes them over gate and up, which lie side by side in the forward's
# one output). Fewer, larger GEMMs run closer to the card's rate, and dx is written once.


def _stackable(layers: Sequence[nn.Module]) -> bool:
    if len(layers) < 2 or any(type(m) is not nn.Linear for m in layers):
        return False  # dense bases only: a 4-bit base is its own packed format
    w0 = layers[0].weight
    return all(
        m.weight.dtype == w0.dtype
        and m.weight.device == w0.device
        and m.in_features == layers[0].in_features
        and not m.weight.requires_grad
        for m in layers
    )


def stack_bases(layers: Sequence[nn.Module]) -> bool:
    """Move the frozen weights of `layers` (dense nn.Linear bases sharing an input) into one
    buffer, each layer's weight becoming a view of its rows; True when done (or already so).

    The parameters stay the same objects holding the same values, so the model, its state dict
    and PEFT see no change; the memory is the same once the old weights are freed (one layer's
    at a time is held twice while it is copied). `LoRAGroup.stacked_weight` finds the buffer.
    """
    if not _stackable(layers):
        return False
    if _stacked_view(layers) is not None:
        return True
    with torch.no_grad():
        stacked = torch.cat([m.weight.detach() for m in layers], 0)
        row = 0
        for m in layers:
            rows = m.weight.shape[0]
            m.weight.data = stacked[row : row + rows]
            row += rows
    return True


def _stacked_view(layers: Sequence[nn.Module]) -> Optional[torch.Tensor]:
    """The [sum of outs, in] tensor that the layers' weights are consecutive rows of, else None.
    The rows may be longer than `in` (folded bases, engine.fastpath.lora_fold: the view then has
    their row stride)."""
    if not _stackable(layers):
        return None
    ws = [m.weight for m in layers]
    w0 = ws[0]
    ld = w0.stride(0) if w0.shape[0] > 1 else w0.shape[1]
    storage = w0.untyped_storage().data_ptr()
    end = w0.data_ptr()
    for w in ws:
        if w.stride(1) != 1 or (w.shape[0] > 1 and w.stride(0) != ld) or ld < w.shape[1]:
            return None
        if w.data_ptr() != end or w.untyped_storage().data_ptr() != storage:
            return None
        end += w.shape[0] * ld * w.element_size()
    rows = sum(w.shape[0] for w in ws)
    return w0.detach().as_strided((rows, w0.shape[1]), (ld, 1))


def as_group(parts) -> LoRAGroup:
    return parts if isinstance(parts, LoRAGroup) else LoRAGroup(parts)
