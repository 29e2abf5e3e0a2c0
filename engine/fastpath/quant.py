"""4-bit bitsandbytes base layers (QLoRA) for the fused LoRA path: recognise, check, dequantize.

The fused LoRA Functions (engine.fastpath.lora) read every frozen base weight through
`base_weight` (engine.fastpath.lora_group); for a bitsandbytes `Linear4bit` (NF4 or FP4) that
calls `dequantize` here, which returns a fresh dense [out, in] copy in the compute dtype. The
caller uses it for one matmul and drops it, in forward and again in backward (dx = dy W), as
bitsandbytes' own matmul does: nothing dequantized is saved for backward or outlives the call,
so the 4-bit memory saving holds and only one layer's dense weight exists at a time.

bitsandbytes and PEFT's bnb LoRA layers are looked up in `sys.modules` instead of imported: a
model can only hold their layers once they are imported, and dense models stay free of the
import (and of the messages bitsandbytes prints on machines without its GPU libraries).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

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
    """A fresh dense [out, in] copy of a 4-bit layer's weight in `dtype`; use it and drop it."""
    from bitsandbytes.functional import dequantize_4bit

    weight = layer.weight
    # bitsandbytes returns [in, out] for a packed tensor laid out as one row (its old
    # transposed calling convention); the canonical one-column layout always gives [out, in].
    dense = dequantize_4bit(weight.data.reshape(-1, 1), weight.quant_state)
    return dense if dense.dtype == dtype else dense.to(dtype)
