"""Per-architecture patch registry: swap module forwards for the fast paths.

`apply_fast_paths(model, fast, device)` takes a PEFT-wrapped transformers causal LM and replaces
the forwards of three kinds of module, and of the decoder layers only to fuse a residual add
with the norm after it (HF's gradient checkpointing, masks and kwargs plumbing stay as they are):

- RMSNorm modules -> `engine.kernels.rmsnorm.rms_norm` (Gemma's ``1 + w`` via offset=1).
- the gated MLP -> `engine.fastpath.lora.lora_mlp` (fused LoRA gate/up/down with the gated
  activation in between), or stock projections + the activation kernel when LoRA cannot fuse.
- attention -> fused LoRA QKV, Qwen3's q/k RMSNorm, RoPE kernel in place on [B, T, H, D] (per-head
  q/k norms and the rotation as one engine.kernels.qk_norm_rope launch each way: fast_paths.qk_norm_rope),
  then whatever attention function `config._attn_implementation` names in transformers'
  registry (so the packed varlen function of engine.fastpath.attention, sdpa or eager all work, and the
  packing kwargs cu_seq_lens_q/k, max_length_q/k, position_ids pass through untouched), then
  fused LoRA O.
- the decoder layer -> the stock layer's steps, op for op, except that the residual add after
  attention and the norm after it (post_attention_layernorm; Gemma-2's pre_feedforward_layernorm)
  are one `engine.kernels.add_rmsnorm` launch each way (fast_paths.add_rmsnorm). The add after
  the MLP stays a torch add: fusing it with the next layer's input norm would move work across
  the layer boundary that gradient checkpointing and offload recompute per layer.

The registry is keyed by `config.model_type` (engine.models.arch: one file per architecture);
unknown types keep the stock path. Each patched forward checks, per call, the state it was planned
for (adapters enabled and unmerged, dtypes, no autocast, no KV cache) and otherwise calls the stock
forward, so generation with a cache and `disable_adapter()` keep working; each such call is counted
with its reason (engine.counters, "fallback:<module kind>: <reason>"), so a step reports what
actually ran. Nothing unsupported raises: it keeps the stock path and the report says why.

The report maps each fast path (rmsnorm, rope, activations, lora_qkv, lora_o, lora_mlp) to
"on" (every module of that kind patched), "partial k/n: <reason for the rest>", or
"off: <reason>".

Quantized models: projections over 4-bit bitsandbytes bases (QLoRA, NF4) run the same fused
LoRA Functions, which dequantize each base weight right before its matmul (engine.fastpath.quant);
other quantized layers (8-bit, ...) keep PEFT's path and the report says why.

Device policy: "auto" applies the patches on CUDA *and* CPU. On a CPU the kernels dispatch to
their torch references and the LoRA Functions run as plain torch matmuls, so the demo and CI run
the same code path as the GPU, with identical results up to rounding. Other device types
(mps, xpu) keep the stock path under "auto".
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from engine.counters import count_fallback
from engine.fastpath import patching, recompute
from engine.fastpath.lora import GatedAct, lora_linears, lora_mlp, lora_mlp_tail, lora_mlp_unread, mlp_can_skip_output
from engine.fastpath.lora_fold import fold_bases, fold_rows, mark_spare
from engine.fastpath.lora_group import LoRAGroup, base_dtype, lora_parts, lora_unsupported_reason, stack_bases
from engine.fastpath.tiled_mlp import KIND as TILED_KIND
from engine.kernels.rope import rope_reference
from engine.models.arch import arch_for
from engine.models.arch import patched as patched_archs
from engine.peft_model import hf_model

FAST_PATHS = ("rmsnorm", "add_rmsnorm", "rope", "activations", "lora_qkv", "lora_o", "lora_mlp")
_KIND = "patches"  # engine.fastpath.patching kind of the forwards installed here


# -- the registry ----------------------------------------------------------------------------------

# The architectures patched here, {model_type: engine.models.arch.Arch}: each one's class names
# (f"{prefix}RMSNorm", ...), its norm offset (Gemma's 1 + w), q/k norms and the attention kwargs
# (sliding window, softcapping) live in its own file under engine/models/arch/.
REGISTRY = patched_archs()


# Why an architecture's plain (ungated) MLP keeps its stock forward.
_UNGATED = "off: {}'s MLP is not gated (up -> act -> down keeps the stock forward)"


def describe_fast_paths(model_type: str) -> dict[str, str]:
    """{fast path: "on" | why it is off} for an architecture, from its model_type alone.

    What a run of this architecture gets on a CUDA GPU with every switch on "auto"; the run's
    own report (apply_fast_paths) can still turn single modules off (dropout, DoRA, 8-bit
    bases, ...); 4-bit (NF4) bases run the fused LoRA paths like 16-bit ones. Packed
    attention and the fused cross-entropy apply to every architecture; "packed_rows" says whether
    several documents share a row's forward (engine.models.arch.packing).
    """
    if model_type in REGISTRY:
        report = {name: "on" for name in FAST_PATHS}
    else:
        known = ", ".join(sorted(REGISTRY))
        report = {name: f"off: model_type '{model_type}' has no patch (patched: {known})" for name in FAST_PATHS}
    report["packed_attention"] = "on"
    report["fused_ce"] = "on"
    arch = arch_for(model_type)
    if model_type in REGISTRY and not arch.gated_mlp:
        report["activations"] = report["lora_mlp"] = _UNGATED.format(model_type)
    if model_type in REGISTRY and not arch.fused_add_norm:
        report["add_rmsnorm"] = f"off: {model_type}'s decoder layer is not one it reproduces"
    if arch is not None and arch.moe is not None and arch.moe.grouped:
        # Experts stay frozen (LoRA trains attention); their blocks take the grouped path.
        for name in ("activations", "lora_mlp"):
            report[name] = "off: the MoE experts stay frozen; engine.fastpath.moe groups them instead"
        report["moe_grouping"] = "on"
    from engine.models.arch.packing import documents_alone

    alone = documents_alone(model_type)
    # Said before a run, so a family that trains each document alone is not a surprise in the log.
    report["packed_rows"] = "on" if alone is None else f"off: {alone}; each document of a row runs as its own forward"
    return report


# -- kernels -------------------------------------------------------------------------------------


@dataclass
class _Kernels:
    """The kernel functions to use, or the reason each is unavailable."""

    impl: str  # "auto": the kernels' own dispatch (Triton on CUDA); "triton": always Triton
    rms_norm: Optional[Callable] = None
    add_rms_norm: Optional[Callable] = None
    rms_norm_passing: Optional[Callable] = None  # (rmsnorm(x), x), from add_rmsnorm's file
    apply_rope: Optional[Callable] = None
    qk_norm_rope: Optional[Callable] = None  # Triton only: the attention forward calls it on CUDA (or when forced)
    activations: bool = False
    missing: dict = field(default_factory=dict)

    @classmethod
    def load(cls, impl: str) -> "_Kernels":
        k = cls(impl)
        for key, mod_name, fn_name in (
            ("rmsnorm", "engine.kernels.rmsnorm", "rms_norm"),
            ("add_rmsnorm", "engine.kernels.add_rmsnorm", "add_rms_norm"),
            ("rope", "engine.kernels.rope", "apply_rope"),
            ("activations", "engine.kernels.activations", "swiglu"),
        ):
            try:
                mod = importlib.import_module(mod_name)
                fn = getattr(mod, fn_name + ("_triton" if impl == "triton" else ""))
            except Exception as exc:  # a broken kernel file must not stop training
                k.missing[key] = f"off: {mod_name} unavailable ({type(exc).__name__}: {exc})"
                continue
            if key == "rmsnorm":
                k.rms_norm = fn
            elif key == "add_rmsnorm":
                k.add_rms_norm = fn
                k.rms_norm_passing = getattr(mod, "rms_norm_passing" + ("_triton" if impl == "triton" else ""))
            elif key == "rope":
                k.apply_rope = fn
            else:
                k.activations = True
        try:
            from engine.kernels.qk_norm_rope import qk_norm_rope
        except Exception as exc:  # a broken kernel file must not stop training
            k.missing["qk_norm_rope"] = f"off: engine.kernels.qk_norm_rope unavailable ({type(exc).__name__}: {exc})"
        else:
            k.qk_norm_rope = qk_norm_rope
        return k


def _act_kind(act_fn: nn.Module) -> tuple[Optional[str], str]:
    """The gated-activation kind of an MLP's act_fn, or (None, reason)."""
    name = type(act_fn).__name__
    if isinstance(act_fn, nn.SiLU) or name == "SiLUActivation":
        return "silu", ""
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"):
        return "gelu_tanh", ""
    if isinstance(act_fn, nn.GELU):
        return ("gelu_tanh" if act_fn.approximate == "tanh" else "gelu"), ""
    if name == "GELUActivation":
        return "gelu", ""
    return None, f"activation {name} has no gated kernel"


# -- patched forwards -----------------------------------------------------------------------------


def _rmsnorm_forward(self, plan: dict, hidden_states: torch.Tensor) -> torch.Tensor:
    # Llama-style norms return weight * x.to(dtype): an fp32 weight on bf16 activations would
    # promote the output, which the kernel does not; that rare mix keeps the stock forward.
    if plan["offset"] == 0.0 and self.weight.dtype != hidden_states.dtype:
        count_fallback("rmsnorm", "weight dtype differs from the activations")
        return plan["stock"](hidden_states)
    spare = plan.get("spare", 0)  # free columns for the folded group that reads the output next
    if not spare:
        return plan["fn"](hidden_states, self.weight, getattr(self, plan["eps_attr"]), plan["offset"])
    y = plan["fn"](hidden_states, self.weight, getattr(self, plan["eps_attr"]), plan["offset"], spare)
    return mark_spare(y, spare)


@dataclass
class _MLPPlan:
    stock: Callable
    act: GatedAct
    groups: Optional[tuple[LoRAGroup, LoRAGroup]]  # (gate/up, down); None: LoRA not fused
    act_kernel: bool  # stock projections around the activation kernel


def _lora_runtime_reason(groups, x: torch.Tensor) -> str:
    """Why `LoRAGroup.runtime_ok` refused x: the same checks, spelled out (fallback path only)."""
    if torch.is_autocast_enabled(x.device.type):
        return "autocast"
    for group in groups:
        for p in group.parts:
            if base_dtype(p.base) != x.dtype:
                return "activation dtype differs from the base layer's"
            if p.adapter is not None:
                layer = p.layer
                if layer.disable_adapters:
                    return "adapters disabled"
                if layer.merged:
                    return "adapter merged"
                if layer.active_adapters != [p.adapter]:
                    return "active adapter changed"
    return "runtime check failed"


def _mlp_forward(self, plan: _MLPPlan, x: torch.Tensor) -> torch.Tensor:
    groups = plan.groups
    reason = None
    if groups is not None:
        if groups[0].runtime_ok(x) and groups[1].runtime_ok(x):
            return lora_mlp(x, groups[0], groups[1], act=plan.act)
        reason = _lora_runtime_reason(groups, x)
    if plan.act_kernel and not torch.is_autocast_enabled(x.device.type):
        if reason is not None:  # stock projections around the activation kernel
            count_fallback("lora_mlp", reason)
        return self.down_proj(plan.act(self.gate_proj(x), self.up_proj(x)))
    count_fallback("mlp", reason or "autocast")
    return plan.stock(x)


@dataclass
class _AttnPlan:
    stock: Callable
    consumed: frozenset  # named parameters of the stock forward (not passed on to attention)
    eager: Callable  # the module's own eager attention (Gemma2's applies softcapping)
    attn_kwargs: Callable[[nn.Module], dict]
    qk_norm: bool
    qk_norm_projection: bool  # OLMo's q/k norms span the whole projection, before the split into heads
    qkv: Optional[LoRAGroup]  # q/k/v planned once (with its per-step adapter weight cache)
    o: Optional[LoRAGroup]
    rope: Optional[Callable]  # kernel apply_rope; None: the torch rotation
    rope_always_inplace: bool  # the forced-Triton path rotates in place even on CPU
    use_rope: bool = True  # False on NoPE layers (SmolLM3's, EXAONE-4's global ones: Arch.uses_rope)
    # engine.kernels.qk_norm_rope's qk_norm_rope for per-head q/k norms (fast_paths.qk_norm_rope); None: apart
    qk_norm_rope: Optional[Callable] = None
    norm_offset: float = 0.0  # the q/k norms' offset (Gemma's 1 + w), for the fused kernel


def _attention_interface(impl: Optional[str], eager: Callable) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
    if impl in (None, "eager"):  # older transformers: eager is the module-level default
        return eager
    return ALL_ATTENTION_FUNCTIONS[impl]


def _stock_attention_reason(args, cache, hidden_states) -> str:
    if cache is not None:
        return "KV cache"
    if torch.is_autocast_enabled(hidden_states.device.type):
        return "autocast"
    return "positional arguments" if args else "no position embeddings"


def _attention_forward(
    self, plan: _AttnPlan, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs
):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if args or cache is not None or position_embeddings is None or torch.is_autocast_enabled(hidden_states.device.type):
        # Generation with a KV cache (or an unforeseen call shape): the stock forward knows
        # this transformers version's cache API.
        count_fallback("attention", _stock_attention_reason(args, cache, hidden_states))
        if args:
            return plan.stock(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        return plan.stock(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
    for key in plan.consumed:
        kwargs.pop(key, None)

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if plan.qkv is not None and plan.qkv.runtime_ok(hidden_states):
        q, k, v = lora_linears(hidden_states, plan.qkv)
    else:
        if plan.qkv is not None:
            count_fallback("lora_qkv", _lora_runtime_reason((plan.qkv,), hidden_states))
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    # The normed input's last reader: in the lean recompute its memory goes now, not when the layer returns.
    recompute.release_remade(hidden_states)
    if plan.qk_norm_projection:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    cos, sin = position_embeddings
    fused = plan.qk_norm_rope is not None and (plan.rope_always_inplace or q.is_cuda)
    if fused:
        why = _qk_norm_rope_reason(self, q, plan.norm_offset)
        if why is not None:
            count_fallback("qk_norm_rope", why)
            fused = False
    if fused:  # both norms and the rotation in one kernel
        eps_q, eps_k = _norm_eps(self.q_norm), _norm_eps(self.k_norm)
        q, k = plan.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, eps_q, eps_k, plan.norm_offset)
    elif plan.qk_norm and not plan.qk_norm_projection:
        q, k = self.q_norm(q), self.k_norm(k)

    if not plan.use_rope or fused:  # a layer without position rotation (NoPE), or rotated above
        pass
    elif plan.rope is None:  # transformers' own rotation, op for op (uncounted: rope is off)
        q, k = rope_reference(q, k, cos, sin)
    else:
        if plan.qk_norm and (plan.rope_always_inplace or q.is_cuda):
            # The in-place rotation cannot run on a view made inside another autograd Function
            # (the RMSNorm kernel returns one); a private copy makes it legal. No-op otherwise.
            q = q.clone() if q._is_view() else q.contiguous()
            k = k.clone() if k._is_view() else k.contiguous()
        q, k = plan.rope(q, k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    attention = _attention_interface(self.config._attn_implementation, plan.eager)
    attn_output, attn_weights = attention(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **plan.attn_kwargs(self),
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if plan.o is not None and plan.o.runtime_ok(attn_output):
        (attn_output,) = lora_linears(attn_output, plan.o)
    else:
        if plan.o is not None:
            count_fallback("lora_o", _lora_runtime_reason((plan.o,), attn_output))
        attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def _norm_eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _qk_norm_rope_reason(attn: nn.Module, q: torch.Tensor, offset: float) -> Optional[str]:
    """Why this call's q/k norms cannot run fused with the rotation (None: they can): the fused
    kernel stands in for the patched RMSNorm forwards, so it takes what they take."""
    for norm in (attn.q_norm, attn.k_norm):
        if patching.installed(norm, _KIND) is None:
            return f"{type(norm).__name__} keeps its stock forward"
        if norm.weight.requires_grad:
            return "q/k norm weights are trained"
        if norm.weight.dtype != q.dtype and offset == 0.0:
            return "weight dtype differs from the activations"  # as _rmsnorm_forward
    return None


@dataclass
class _LayerPlan:
    stock: Callable
    fn: Callable  # engine.kernels.add_rmsnorm's add_rms_norm (or its _triton form)
    offset: float
    eps_attr: str  # the fused norm's epsilon attribute
    sandwich: bool  # Gemma-2: attention output normed before the add, the MLP's after it
    # transformers >= 5.2x checkpoints inside the class's forward (GradientCheckpointingLayer wraps
    # it), which an instance forward bypasses, so this forward checkpoints itself; older versions
    # checkpoint in __call__, around whatever forward the instance has.
    checkpoints_in_forward: bool
    # Free columns the fused norm leaves after each row of its output for the MLP's folded gate/up
    # (engine.fastpath.lora_fold); 0: none. Set after the layer's MLP is planned (_leave_spare).
    mlp_spare: int = 0


def _layer_plan(layer: nn.Module, fn: Optional[Callable], offset: float) -> tuple[Optional[_LayerPlan], Optional[str]]:
    """The plan for a decoder layer of the usual shape, or (None, why it keeps the stock forward)."""
    if fn is None:
        return None, "no add_rmsnorm kernel"
    sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    needed = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    missing = [name for name in needed if not hasattr(layer, name)]
    if missing:
        return None, f"{type(layer).__name__} has no {', '.join(missing)}"
    norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
    eps_attr = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
    if not hasattr(norm, eps_attr) or getattr(norm, "weight", None) is None:
        return None, f"{type(norm).__name__} has no weight or epsilon"
    class_forward = getattr(type(layer), "forward", None)
    in_forward = getattr(getattr(class_forward, "__code__", None), "co_name", "") == "forward_with_checkpointing"
    return _LayerPlan(layer.forward, fn, offset, eps_attr, sandwich, in_forward), None


def _decoder_layer_forward(self, plan: _LayerPlan, hidden_states, *args, **kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if args or cache is not None:  # generation, or a call shape this forward was not planned for
        count_fallback("add_rmsnorm", "positional arguments" if args else "KV cache")
        return plan.stock(hidden_states, *args, **kwargs)
    if plan.checkpoints_in_forward and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
        # What the class's checkpointing wrapper does (with no cache, nothing of it to switch off);
        # engine.fastpath.offload's function, when installed, is this _gradient_checkpointing_func.
        kwargs.pop("use_cache", None)
        return self._gradient_checkpointing_func(partial(_fused_layer, self, plan, **kwargs), hidden_states)
    return _fused_layer(self, plan, hidden_states, **kwargs)


def _fused_layer(self, plan: _LayerPlan, hidden_states, **kwargs):
    # The stock layer's steps with the add after attention fused into the norm that follows it.
    hidden_states, residual = _input_norm(self.input_layernorm, hidden_states)
    if plan.sandwich:  # Gemma-2's layer does not pass use_cache on to its attention
        kwargs.pop("use_cache", None)
    # Offload's recompute (fast_paths.lean_recompute): the normed input is remade for q/k/v's backward, not
    # kept, and the attention frees it once q/k/v are made (release_remade). Never where the norm handed
    # back the residual's own memory (an identity norm), which the add below reads.
    unused = recompute.layer_output_unused()
    lean = recompute.lean()
    own = hidden_states.untyped_storage().data_ptr() != residual.untyped_storage().data_ptr()
    with recompute.remade_when_unpacked(hidden_states, partial(self.input_layernorm, residual), lean, own):
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    if plan.sandwich:
        hidden_states = self.post_attention_layernorm(hidden_states)
    norm = self.pre_feedforward_layernorm if plan.sandwich else self.post_attention_layernorm
    reason = None
    if hidden_states.dtype != residual.dtype:  # under autocast, the attention's output is the cast dtype
        reason = "autocast" if torch.is_autocast_enabled(residual.device.type) else "dtype differs from the residual's"
    elif plan.offset == 0.0 and norm.weight.dtype != hidden_states.dtype:
        reason = "weight dtype differs from the activations"  # as _rmsnorm_forward: promotes in the stock
    if reason is None and not plan.sandwich and lean:
        mlp = _unread_mlp(self.mlp, hidden_states)
        if mlp is not None:  # offload's recompute: the output only roots the backward (fast_paths.lean_recompute)
            return lora_mlp_unread(residual + hidden_states, norm, *mlp)
    if reason is None and plan.mlp_spare:
        hidden_states, residual = plan.fn(
            hidden_states, residual, norm.weight, getattr(norm, plan.eps_attr), plan.offset, plan.mlp_spare
        )
        mark_spare(hidden_states, plan.mlp_spare)
    elif reason is None:
        hidden_states, residual = plan.fn(
            hidden_states, residual, norm.weight, getattr(norm, plan.eps_attr), plan.offset
        )
    else:
        count_fallback("add_rmsnorm", reason)
        residual = residual + hidden_states
        hidden_states = norm(residual)
    if unused and not plan.sandwich and recompute.tail_on():
        mlp = _fused_mlp(self.mlp, hidden_states)
        if mlp is not None:  # offload's recompute: neither the down projection's output nor the add is made
            return lora_mlp_tail(residual, hidden_states, *mlp)
    hidden_states = self.mlp(hidden_states)
    if plan.sandwich:
        hidden_states = self.post_feedforward_layernorm(hidden_states)
    return residual + hidden_states


def _input_norm(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x) for a layer's input norm. Where it is our patched norm and x takes a gradient,
    one Function returns both (engine.kernels.add_rmsnorm.rms_norm_passing): x's two gradients, the
    norm's and the residual stream's, are then added inside the norm's backward kernel instead of
    by autograd after it (one add of the row per layer). A norm with hooks is called as a module.
    TUNESMITH_PASSING_NORM=0 (bench.ours's `passing_norm=false`) keeps the stock pair, for bench's
    before/after."""
    patch = patching.installed(norm, _KIND)
    plan = None if patch is None or patch.fn is not _rmsnorm_forward else patch.plan
    if (
        plan is None
        or plan.get("passing") is None
        or not (x.requires_grad and torch.is_grad_enabled())
        or norm._forward_hooks
        or norm._forward_pre_hooks
        or os.environ.get("TUNESMITH_PASSING_NORM", "1") == "0"
        or (plan["offset"] == 0.0 and norm.weight.dtype != x.dtype)  # as _rmsnorm_forward: the stock one
    ):
        return norm(x), x
    spare = plan.get("spare", 0)
    y, passed = plan["passing"](x, norm.weight, getattr(norm, plan["eps_attr"]), plan["offset"], spare)
    return (mark_spare(y, spare) if spare else y), passed


def _fused_mlp(mlp: nn.Module, x: torch.Tensor, inside_tiled: bool = False) -> Optional[tuple]:
    """(gate_up, down, act) of a fused LoRA MLP that will take x, else None; `inside_tiled`: also
    the fused MLP a tiled one (engine.fastpath.tiled_mlp) wraps."""
    patch = patching.installed(mlp, _KIND)
    if patch is None and inside_tiled:
        inner = getattr(getattr(patching.installed(mlp, TILED_KIND), "plan", None), "inner", None)
        if isinstance(inner, patching.PatchedForward) and inner.kind == _KIND:
            patch = inner
    plan = None if patch is None else patch.plan
    if not isinstance(plan, _MLPPlan) or plan.groups is None:
        return None
    if not (plan.groups[0].runtime_ok(x) and plan.groups[1].runtime_ok(x)):
        return None
    return (*plan.groups, plan.act)


def _unread_mlp(mlp: nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """(gate_up, down, act) of a fused LoRA MLP that `lora_mlp_unread` can stand in for, else None.

    A tiled MLP wraps the fused one; LoRAMLPUnread's backward runs row tiles of its own, so the
    stand-in serves it too, and then neither the normed input TiledMLP keeps nor the layer's output
    is made (two activations of the row less at the backward's peak on W7's long rows, and one MLP
    forward less)."""
    parts = _fused_mlp(mlp, x, inside_tiled=True)
    return parts if parts is not None and mlp_can_skip_output(*parts[:2]) else None


# -- planning -------------------------------------------------------------------------------------


class _Tally:
    """Per fast path: modules patched, modules seen, and why the others were not."""

    def __init__(self):
        self.on: Counter = Counter()
        self.seen: Counter = Counter()
        self.why: dict[str, Counter] = {k: Counter() for k in FAST_PATHS}

    def add(self, key: str, reason: Optional[str]) -> None:
        self.seen[key] += 1
        if reason is None:
            self.on[key] += 1
        else:
            self.why[key][reason] += 1

    def report(self, key: str, none_found: str) -> str:
        if not self.seen[key]:
            return f"off: {none_found}"
        if self.on[key] == self.seen[key]:
            return "on"
        reason = self.why[key].most_common(1)[0][0]
        reason = reason.removeprefix("off: ")
        if self.on[key] == 0:
            return f"off: {reason}"
        return f"partial {self.on[key]}/{self.seen[key]}: {reason}"


def _group_reason(layers: list[nn.Module]) -> Optional[str]:
    for layer in layers:
        reason = lora_unsupported_reason(layer)
        if reason is not None:
            return reason
    if all(lora_parts(layer).adapter is None for layer in layers):
        return "no LoRA adapter on these projections"
    return None


def _switch(value: Any, name: str, device: torch.device) -> Optional[str]:
    """None when fast path switch `name` is on for `device`, else the reason it is off."""
    if value is True:
        return None
    if value is False:
        return f"off: fast_paths.{name} is false"
    if value == "auto":
        if device.type in ("cuda", "cpu"):
            return None
        return f"off: auto keeps the stock path on {device.type}"
    return f"off: fast_paths.{name} has unknown value {value!r}"


def _stock_signature_names(forward: Callable) -> frozenset:
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        params = []
    named = {p.name for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    # Both names of the KV cache argument (5.24 renamed past_key_values -> cache).
    named |= {"cache", "past_key_values"}
    return frozenset(named - {"self", "hidden_states", "position_embeddings", "attention_mask"})


def _install(module: nn.Module, forward: Callable, plan: Any) -> None:
    patching.install(module, forward, plan, _KIND)


def dense_mlps(model: nn.Module) -> tuple[list[nn.Module], str]:
    """(the dense gated MLP modules of a (PEFT-wrapped) causal LM, why there are none)."""
    hf = hf_model(model)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    arch = REGISTRY.get(model_type)
    if arch is None:
        return [], f"model_type '{model_type}' has no patch"
    mlp_cls = arch.classes()[2]
    mlps = [m for m in hf.modules() if type(m).__name__ == mlp_cls]
    return mlps, "" if mlps else f"no {mlp_cls} modules found"


def _leave_spare(hf: nn.Module, layer_cls: str) -> None:
    """Have each decoder layer's patched norms write their output with free columns after each row
    for the folded group that reads it next (q/k/v after input_layernorm, gate/up after the MLP's
    norm), so that group puts x A^T there instead of copying x into a wide buffer
    (engine.fastpath.lora_fold). Done once everything is planned: the norms are patched before
    the attention and MLP they feed, in module order."""

    def spare_of(module: Optional[nn.Module], get_group: Callable) -> int:
        patch = None if module is None else patching.installed(module, _KIND)
        group = None if patch is None else get_group(patch.plan)
        fold = None if group is None else group.fold
        return 0 if fold is None else fold.width

    def give(norm: Optional[nn.Module], spare: int) -> None:
        patch = None if norm is None else patching.installed(norm, _KIND)
        if patch is not None and isinstance(patch.plan, dict):
            patch.plan["spare"] = spare

    def qkv_of(plan) -> Optional[LoRAGroup]:
        return getattr(plan, "qkv", None)

    def gate_up_of(plan) -> Optional[LoRAGroup]:
        groups = getattr(plan, "groups", None)  # the MLP's (gate/up, down)
        return None if groups is None else groups[0]

    for layer in hf.modules():
        if type(layer).__name__ != layer_cls:
            continue
        give(getattr(layer, "input_layernorm", None), spare_of(getattr(layer, "self_attn", None), qkv_of))
        mlp_spare = spare_of(getattr(layer, "mlp", None), gate_up_of)
        sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")
        give(getattr(layer, "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm", None), mlp_spare)
        patch = patching.installed(layer, _KIND)
        if patch is not None and isinstance(patch.plan, _LayerPlan):
            patch.plan.mlp_spare = mlp_spare


def _qkv_group(attn: nn.Module, nf4: str, fold) -> LoRAGroup:
    """The q/k/v projections' group, their bases folded (engine.fastpath.lora_fold) as `fold`
    (fast_paths.fold_lora) says."""
    group = LoRAGroup([lora_parts(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], nf4)
    if fold is not False:
        fold_bases(group, False, fold)
    return group


def _o_group(attn: nn.Module, nf4: str, fold) -> LoRAGroup:
    """o_proj's group, its base folded by rows for the input gradient (lora_fold.fold_rows) as `fold`
    (fast_paths.fold_lora) says."""
    group = LoRAGroup([lora_parts(attn.o_proj)], nf4)
    if fold is not False:
        fold_rows(group, fold)
    return group


def remove_fast_paths(model: nn.Module) -> int:
    """Restore every stock forward `apply_fast_paths` replaced; returns how many."""
    return sum(patching.uninstall(module, _KIND) for module in list(model.modules()))


def apply_fast_paths(model: nn.Module, fast, device, *, kernel_impl: str = "auto") -> dict[str, str]:
    """Patch `model` (a PEFT model over a transformers causal LM) in place; see module docs.

    `fast` is an engine.config.FastPathConfig (kernels and lora_autograd are read here; fused
    CE and packed attention belong to other modules). `kernel_impl="triton"` forces the Triton
    kernels even on CPU tensors (tests, with TRITON_INTERPRET=1). Calling it again first undoes
    the previous patches, so a changed config takes effect.
    """
    if kernel_impl not in ("auto", "triton"):
        raise ValueError(f"kernel_impl must be 'auto' or 'triton', got {kernel_impl!r}")
    device = torch.device(device)
    remove_fast_paths(model)
    hf = hf_model(model)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    arch = REGISTRY.get(model_type)
    if arch is None:
        return {k: f"off: model_type '{model_type}' has no patch" for k in FAST_PATHS}

    kernels_off = _switch(getattr(fast, "kernels", "auto"), "kernels", device)
    lora_off = _switch(getattr(fast, "lora_autograd", "auto"), "lora_autograd", device)
    # NF4 bases: decoded inside the matmul (engine.kernels.nf4_matmul) only when asked for; auto
    # keeps dequantize + cuBLAS, 3.5-18x faster per product on the H200 (docs/gpu-test-log.md).
    nf4 = "auto" if getattr(fast, "nf4_matmul", "auto") is True else "off"
    stack_off = _switch(getattr(fast, "stacked_bases", "auto"), "stacked_bases", device)
    fold = getattr(fast, "fold_lora", "auto")  # width and layout rules: engine.fastpath.lora_fold
    fold_off = _switch(fold, "fold_lora", device)
    k = _Kernels.load(kernel_impl) if kernels_off is None else _Kernels(kernel_impl)
    kernel_off = {
        "rmsnorm": kernels_off or (k.missing.get("rmsnorm") if k.rms_norm is None else None),
        "rope": kernels_off or (k.missing.get("rope") if k.apply_rope is None else None),
        "activations": kernels_off or (k.missing.get("activations") if not k.activations else None),
    }
    add_norm_off = (
        kernels_off
        or _switch(getattr(fast, "add_rmsnorm", "auto"), "add_rmsnorm", device)
        or (k.missing.get("add_rmsnorm") if k.add_rms_norm is None else None)
        or (None if arch.fused_add_norm else f"off: {model_type}'s decoder layer is not one it reproduces")
    )
    # Per-head q/k norms fused with the rotation: where both the norm and the RoPE kernels run.
    fuse_qk_rope = (
        arch.qk_norm
        and arch.qk_norm_width == "head"
        and kernel_off["rmsnorm"] is None
        and kernel_off["rope"] is None
        and k.qk_norm_rope is not None
        and _switch(getattr(fast, "qk_norm_rope", "auto"), "qk_norm_rope", device) is None
    )
    act_impl = "triton" if kernel_impl == "triton" else "kernels"
    norm_cls, attn_cls, mlp_cls = arch.classes()
    layer_cls = arch.hf_classes.decoder_layer
    tally = _Tally()

    for module in list(hf.modules()):
        cls = type(module).__name__
        if cls == layer_cls:
            layer_plan, why = _layer_plan(module, k.add_rms_norm, arch.norm_offset)
            tally.add("add_rmsnorm", add_norm_off or why)
            if add_norm_off is None and layer_plan is not None:
                _install(module, _decoder_layer_forward, layer_plan)

        elif cls == norm_cls:
            tally.add("rmsnorm", kernel_off["rmsnorm"])
            eps_attr = "variance_epsilon" if hasattr(module, "variance_epsilon") else "eps"
            if kernel_off["rmsnorm"] is None and hasattr(module, eps_attr):
                plan = {
                    "stock": module.forward,
                    "fn": k.rms_norm,
                    "passing": k.rms_norm_passing if add_norm_off is None else None,
                    "offset": arch.norm_offset,
                    "eps_attr": eps_attr,
                }
                _install(module, _rmsnorm_forward, plan)

        elif cls == mlp_cls and not arch.gated_mlp:  # up -> act -> down: the fused MLP is a gated one
            tally.add("lora_mlp", _UNGATED.format(model_type))
            tally.add("activations", _UNGATED.format(model_type))

        elif cls == mlp_cls:
            kind, act_reason = _act_kind(getattr(module, "act_fn", None))
            lora_reason = lora_off or _group_reason([module.gate_proj, module.up_proj, module.down_proj])
            if kind is None:
                lora_reason = lora_reason or act_reason
            act_reason = kernel_off["activations"] or (act_reason or None)
            fused = lora_reason is None
            act = GatedAct(kind or "silu", act_impl if act_reason is None else "torch")
            tally.add("lora_mlp", lora_reason)
            tally.add("activations", act_reason)
            if fused or act_reason is None:
                groups = (
                    (
                        LoRAGroup([lora_parts(module.gate_proj), lora_parts(module.up_proj)], nf4),
                        LoRAGroup([lora_parts(module.down_proj)], nf4),
                    )
                    if fused
                    else None
                )
                if groups is not None and not (fold_off is None and fold_bases(groups[0], stack_off is None, fold)):
                    if stack_off is None:
                        stack_bases(groups[0].bases)
                if groups is not None and fold_off is None:
                    fold_rows(groups[1], fold)  # down's input gradient: [dy | dy sB] [W; A]
                _install(module, _mlp_forward, _MLPPlan(module.forward, act, groups, act_reason is None))

        elif cls == attn_cls:
            qkv_reason = lora_off or _group_reason([module.q_proj, module.k_proj, module.v_proj])
            o_reason = lora_off or _group_reason([module.o_proj])
            rope_reason = kernel_off["rope"]
            tally.add("lora_qkv", qkv_reason)
            tally.add("lora_o", o_reason)
            tally.add("rope", rope_reason)
            if qkv_reason is None or o_reason is None or rope_reason is None:
                stock = module.forward
                modeling = sys.modules.get(type(module).__module__)
                eager = getattr(modeling, "eager_attention_forward", None)
                if eager is None:
                    from transformers.models.llama.modeling_llama import (
                        eager_attention_forward as eager,
                    )
                plan = _AttnPlan(
                    stock=stock,
                    consumed=_stock_signature_names(stock),
                    eager=eager,
                    attn_kwargs=arch.attn_kwargs,
                    qk_norm=arch.qk_norm,
                    qk_norm_projection=arch.qk_norm and arch.qk_norm_width == "projection",
                    qkv=_qkv_group(module, nf4, fold if fold_off is None else False) if qkv_reason is None else None,
                    o=_o_group(module, nf4, fold if fold_off is None else False) if o_reason is None else None,
                    rope=k.apply_rope if rope_reason is None else None,
                    rope_always_inplace=kernel_impl == "triton",
                    use_rope=arch.uses_rope(module),
                    qk_norm_rope=k.qk_norm_rope if fuse_qk_rope and arch.uses_rope(module) else None,
                    norm_offset=arch.norm_offset,
                )
                _install(module, _attention_forward, plan)

    _leave_spare(hf, layer_cls)
    if fold_off is None and device.type == "cuda" and torch.cuda.is_initialized():
        # Folding moved the frozen weights into wider buffers; the allocator would keep the old ones'
        # blocks reserved for the rest of the run, memory no other process could have. (Runs with the
        # fold reserved more on the H100: W1 2.37 against 2.01 GiB, W3 forced on 22.85 against 17.32.)
        torch.cuda.empty_cache()
    return {
        "rmsnorm": tally.report("rmsnorm", kernel_off["rmsnorm"] or f"no {norm_cls} modules found"),
        "add_rmsnorm": tally.report("add_rmsnorm", add_norm_off or f"no {layer_cls} modules found"),
        "rope": tally.report("rope", kernel_off["rope"] or f"no {attn_cls} modules found"),
        "activations": tally.report("activations", kernel_off["activations"] or f"no {mlp_cls} modules found"),
        "lora_qkv": tally.report("lora_qkv", lora_off or f"no {attn_cls} modules found"),
        "lora_o": tally.report("lora_o", lora_off or f"no {attn_cls} modules found"),
        "lora_mlp": tally.report("lora_mlp", lora_off or f"no {mlp_cls} modules found"),
    }
