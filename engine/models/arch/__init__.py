"""One module per model architecture: what the engine needs to know about it, in one place.

`arch_for(model_type)` gives an architecture's `Arch` (engine.models.arch.spec): its transformers
classes, norms, attention shape facts, MoE block and a tiny test config. engine.models.patches
patches the architectures with `fast_paths`; engine.models.estimate counts parameters with the
facts; tests build tiny models from `Arch.tiny_config` (tests/tiny_models.py).

A new architecture is a new module here with an `ARCH`, listed in `_MODULES` below.
"""

from __future__ import annotations

from typing import Optional

from engine.models.arch import (
    arcee,
    bamba,
    bloom,
    cohere,
    exaone4,
    falcon,
    falcon_h1,
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    granitemoe,
    granitemoehybrid,
    hyperclovax,
    jamba,
    kimi_linear,
    lfm2,
    llama,
    minicpm3,
    ministral,
    mistral,
    nemotron_h,
    olmo2,
    olmo3,
    olmo_hybrid,
    opt,
    phi,
    phi3,
    qwen2,
    qwen2_moe,
    qwen2_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    smollm3,
    starcoder2,
)
from engine.models.arch.spec import GENERIC, TINY_BASE, Arch, HFClasses, MoE

__all__ = [
    "ARCHS",
    "GENERIC",
    "TINY_BASE",
    "Arch",
    "HFClasses",
    "MoE",
    "arch_for",
    "logit_scale",
    "patched",
    "tiny_archs",
]

_MODULES = (
    llama,
    mistral,
    ministral,
    smollm3,
    arcee,
    qwen2,
    qwen2_moe,
    qwen2_vl,
    qwen3,
    qwen3_moe,
    qwen3_next,
    gemma,
    gemma2,
    gemma3,
    olmo2,
    olmo3,
    exaone4,
    phi3,
    granite,
    granitemoe,
    hyperclovax,
    minicpm3,
    cohere,
    falcon_h1,
    lfm2,
    jamba,
    nemotron_h,
    granitemoehybrid,
    bamba,
    qwen3_5,
    olmo_hybrid,
    kimi_linear,
    gpt_oss,
    gpt2,
    gpt_neox,
    gptj,
    phi,
    opt,
    bloom,
    falcon,
    starcoder2,
    gpt_bigcode,
)

# model_type (and each alias) -> its Arch.
ARCHS: dict[str, Arch] = {}
for _module in _MODULES:
    for _name in (_module.ARCH.model_type, *_module.ARCH.aliases):
        if _name in ARCHS:  # two files claiming one model_type: the second would silently win
            raise RuntimeError(f"model_type {_name!r} is claimed by two architecture modules")
        ARCHS[_name] = _module.ARCH


def arch_for(model_type: Optional[str]) -> Optional[Arch]:
    """The Arch of `model_type`, or None for an architecture the engine has no file for."""
    return ARCHS.get(model_type) if model_type else None


def logit_scale(config) -> float:
    """The factor a transformers config's stock forward applies to its head's logits (Arch.logit_scale;
    1.0 for a family without a file)."""
    arch = arch_for(getattr(config, "model_type", None))
    return arch.logit_scale(config) if arch is not None else 1.0


def patched() -> dict[str, Arch]:
    """{model_type: Arch} of the architectures engine.models.patches patches."""
    return {name: arch for name, arch in ARCHS.items() if arch.fast_paths}


def tiny_archs() -> list[str]:
    """model_types with a tiny test config."""
    return [name for name, arch in ARCHS.items() if arch.tiny is not None and name == arch.model_type]
