"""4-bit bitsandbytes base layers (QLoRA) for the fused LoRA path: recognise, check, multiply.

The fused LoRA Functions (engine.fastpath.lora) multiply by every frozen base weight through
`base_operand` / `base_mm` (engine.fastpath.lora_group). With fast_paths.nf4_matmul true, for
an NF4 base on CUDA, `nf4_operand` here hands them the packed weight itself, and `nf4_mm` runs
engine.kernels.nf4_matmul, which decodes W tile by tile inside the matmul (x W^T in forward,
dy W in backward): no dense copy of the weight is written. Where that kernel does not apply
(FP4, a shape it cannot tile, a machine without Triton) the product falls back to
`dequantize`, counted with its reason (``fallback:nf4_matmul: <reason>``); on a CPU dequantize
+ matmul is simply the path. It is off by default: on the H200 it was 3.5-18x slower per
product than dequantize + cuBLAS at W4's and W8's shapes (docs/gpu-test-log.md, 2026-12-01).

`dequantize` returns a fresh dense [out, in] copy in the compute dtype. The caller uses it for
one matmul and drops it, in forward and again in backward (dx = dy W), as bitsandbytes' own
matmul does: nothing dequantized is saved for backward or outlives the call, so the 4-bit
memory saving holds and only one layer's dense weight exists at a time.

bitsandbytes and PEFT's bnb LoRA layers are looked up in `sys.modules` instead of imported: a
model can only hold their layers once they are imported, and dense models stay free of the
import (and of the messages bitsandbytes prints on machines without its GPU libraries).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from engine.counters import count_fallback

QUANT_TYPES = ("nf4", "fp4")  # what bitsandbytes' dequantize_4bit decodes
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _loaded_class(module: str, name: str) -> Optional[type]:
    mod = sys.modules.get(module)
    return None if mod is None else getattr(mod, name, None)


def is_4bit(layer: nn.Module) -> bool:
    """Whether `layer` is a bitsandbytes Linear4bit (its subclasses LinearNF4/LinearFP4 too)."""
    cls = _loaded_class("bitsandbytes.nn", "Linear4bit")
    return cls is not None and isinstance(layer, cls)


def is_peft_lora_4bit(layer: nn.Module) -> bool:
    """Whether `layer` is PEFT's LoRA wrapper around a 4-bit base (peft.tuners.lora.bnb.Linear4bit)."""
    cls = _loaded_class("peft.tuners.lora.bnb", "Linear4bit")
    return cls is not None and isinstance(layer, cls)


def compute_dtype(layer: nn.Module) -> Optional[torch.dtype]:
    """The activation dtype bitsandbytes computes this 4-bit layer in, or None while its
    weight cannot be dequantized (not quantized yet, or repacked for CPU inference)."""
    state = getattr(layer.weight, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False):
        return None
    # Linear4bit casts its input to compute_dtype; unset, bitsandbytes adopts the first
    # input's dtype, and the weight's original dtype is the natural stand-in until then.
    return layer.compute_dtype or state.dtype


def unsupported_reason(layer: nn.Module) -> Optional[str]:
    """None when `layer` (a base that is not a plain nn.Linear) can run fused, else why not."""
    name = type(layer).__name__
    if not is_4bit(layer):
        if type(layer).__module__.startswith("bitsandbytes"):
            return f"base layer is bitsandbytes {name}; only 4-bit (NF4/FP4) quantized bases run the fused path"
        return f"base layer is {type(layer).__module__}.{name}, neither a dense nn.Linear nor a 4-bit Linear4bit"
    weight = layer.weight
    state = getattr(weight, "quant_state", None)
    if state is None:
        return "4-bit base weight is not quantized yet (bitsandbytes quantizes it when moved to a device)"
    if getattr(state, "packing_format_for_cpu", False):
        return "4-bit base weight is repacked for bitsandbytes' CPU inference kernel"
    if state.quant_type not in QUANT_TYPES:
        return f"4-bit quant type {state.quant_type!r} is not one of {', '.join(QUANT_TYPES)}"
    if state.dtype not in _FLOAT_DTYPES or compute_dtype(layer) not in _FLOAT_DTYPES:
        return f"4-bit base dequantizes to {state.dtype} / computes in {layer.compute_dtype}, not bf16/fp16/fp32"
    if weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad):
        return "base weight or bias is trainable (fused path assumes a frozen base)"
    return None


def dequantize(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A fresh dense [out, in] copy of a 4-bit layer's weight in `dtype`; use it and drop it.

    NF4 on CUDA goes through engine.kernels.nf4_dequant, bit-identical to bitsandbytes and
    faster (0.56-0.99x its time per weight at W4's and W8's shapes on the H200); the rest
    through bitsandbytes' dequantize_4bit.
    """
    from bitsandbytes.functional import dequantize_4bit

    weight = layer.weight
    state = weight.quant_state
    if weight.is_cuda and state.quant_type == "nf4" and len(state.shape) == 2:
        from engine.kernels.nf4_dequant import NF4Weight, dequantize_nf4_triton

        # Decoded in bitsandbytes' dtype first, so a cast to another dtype rounds as before.
        dense = dequantize_nf4_triton(NF4Weight.from_bnb(weight.data, state))
        return dense if dense.dtype == dtype else dense.to(dtype)
    # bitsandbytes returns [in, out] for a packed tensor laid out as one row (its old
    # transposed calling convention); the canonical one-column layout always gives [out, in].
    dense = dequantize_4bit(weight.data.reshape(-1, 1), weight.quant_state)
    return dense if dense.dtype == dtype else dense.to(dtype)


# -- the fused NF4 matmul (engine.kernels.nf4_matmul) ---------------------------------------------

NF4_MODES = ("auto", "triton", "off")  # auto: the kernel on CUDA; triton: on any device (tests)


def nf4_operand(layer: nn.Module, a: torch.Tensor, transpose: bool, mode: str = "auto"):
    """The packed weight of a 4-bit `layer` for the fused NF4 matmul of `a` (an NF4Weight), or
    None when the product dequantizes instead: `mode` "off", "auto" off CUDA, or a reason the
    kernel does not apply, which is counted as a fallback."""
    if mode == "off" or (mode == "auto" and not a.is_cuda):
        return None
    from engine.kernels.nf4_dequant import NF4Weight
    from engine.kernels.nf4_matmul import nf4_matmul_supported

    weight = layer.weight
    state = weight.quant_state
    if state.quant_type != "nf4":
        reason = f"4-bit quant type {state.quant_type!r}; the kernel decodes nf4"
    elif len(state.shape) != 2:
        reason = f"4-bit weight of shape {tuple(state.shape)}, not 2-D"
    else:
        w = NF4Weight.from_bnb(weight.data, state)
        reason = nf4_matmul_supported(w, a, transpose)
        if reason is None:
            return w
    count_fallback("nf4_matmul", reason)
    return None


def is_nf4_operand(w) -> bool:
    """Whether `w` (from nf4_operand or a dense weight) is a packed NF4 weight."""
    return not isinstance(w, torch.Tensor)


def nf4_mm(a: torch.Tensor, w, transpose: bool = True, out=None, accumulate: bool = False) -> torch.Tensor:
    """a @ W^T (transpose) or a @ W with W decoded inside the kernel (an nf4_operand's W)."""
    from engine.kernels.nf4_matmul import nf4_matmul_triton

    return nf4_matmul_triton(a, w, transpose, out, accumulate)
