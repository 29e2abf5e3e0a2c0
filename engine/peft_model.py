"""The transformers model under a PEFT wrapper: the one place that unwraps a PeftModel.

Every part of the engine that patches or reads the causal LM (attention, the per-architecture
patches, offload, the step) works on the transformers model; callers may hand it either that
model or the PeftModel around it.
"""

from __future__ import annotations


def hf_model(model):
    """`model.get_base_model()` for a peft.PeftModel, else `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
