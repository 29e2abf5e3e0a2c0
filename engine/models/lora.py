"""Attach LoRA adapters through PEFT, so adapters stay standard PEFT files."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

from engine.config import LoraConfig


def all_linear_names(model) -> list[str]:
    """Names of every Linear layer except the LM head: what "all-linear" means.

    Each is the layer's last name component (q_proj, ...), or as many trailing components as it
    takes to name no other module: PEFT matches a target against the end of a module's path, and a
    Linear kept in a list ("0") would otherwise name every decoder layer too (Zamba-2).

    PEFT's own "all-linear" also puts adapters on MoE experts' 3-D weights and routers
    (target_parameters); here experts stay frozen, so MoE layers keep the grouped expert path
    (engine.fastpath.moe) and LoRA trains attention and any dense MLPs. 4-bit layers are Linear too.
    """
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    refused = _MAMBA_REFUSED if model_type in _MAMBA_TYPES else frozenset()
    wanted, other_suffixes = [], set()
    for name, mod in model.named_modules():
        if not name:
            continue
        parts = name.split(".")
        if _is_projection(mod, nn.Linear) and mod is not head and parts[-1] not in refused:
            wanted.append(parts)
        else:
            other_suffixes.update(".".join(parts[-k:]) for k in range(1, len(parts) + 1))
    names = set()
    for parts in wanted:
        k = next((k for k in range(1, len(parts)) if ".".join(parts[-k:]) not in other_suffixes), len(parts))
        names.add(".".join(parts[-k:]))
    return sorted(names)


# PEFT refuses LoRA on a Mamba mixer's out_proj and conv1d for these model_types
# (peft.tuners.tuners_utils._check_lora_target_modules_mamba): "all-linear" leaves them out.
_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
_MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


def _is_projection(module, linear) -> bool:
    """A Linear layer PEFT's LoRA can wrap: nn.Linear, a bitsandbytes one, transformers' Conv1D
    (GPT-2's transposed Linear, which PEFT wraps with fan_in_fan_out), or a model's own Linear
    subclass known to compute x @ W.T + b and nothing else (`_PLAIN_LINEARS`). Other subclasses are
    not projections: Llama-4's and PhiMoE's routers return tuples, DeepSeek-V4's grouped Linear
    reshapes its input per group, and PEFT's LoRA layer would add to the wrong thing."""
    from transformers.pytorch_utils import Conv1D

    cls = type(module)
    if cls is linear or cls is Conv1D or cls.__name__ in _PLAIN_LINEARS:
        return True
    return isinstance(module, linear) and cls.__module__.split(".")[0] == "bitsandbytes"


# transformers' nn.Linear subclasses whose forward is the plain product (Falcon's skips a transpose).
_PLAIN_LINEARS = frozenset({"FalconLinear"})


def peft_lora_config(cfg: LoraConfig, model=None):
    from peft import LoraConfig as PeftLoraConfig

    if isinstance(cfg.target_modules, list):
        targets = cfg.target_modules
    else:
        targets = all_linear_names(model) if model is not None else "all-linear"
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        fan_in_fan_out=_all_conv1d(model, targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _all_conv1d(model, targets) -> bool:
    """Whether every layer the targets name is a Conv1D (GPT-2 and its kin): PEFT's config then
    says fan_in_fan_out itself, and the adapter_config.json says what its weights are. (PEFT
    would set it on each Conv1D anyway, with a warning; a mix of both kinds keeps False.)"""
    if model is None or not isinstance(targets, list) or not targets:
        return False
    from transformers.pytorch_utils import Conv1D

    hit = [m for name, m in model.named_modules() if any(name == t or name.endswith("." + t) for t in targets)]
    return bool(hit) and all(type(m) is Conv1D for m in hit)


def attach_lora(model, cfg: LoraConfig):
    """Wrap `model` in a PeftModel with fresh LoRA adapters; only they require grad."""
    from peft import get_peft_model

    from engine.models.loading import ignore_peft_conversion_notice

    try:
        with warnings.catch_warnings():
            # PEFT reads transformers' renamed `is_gradient_checkpointing` (transformers 5 warns from
            # inside itself; nothing a user can change): that one warning, here where it starts.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            ignore_peft_conversion_notice()
            with keep_lora_targets():
                return get_peft_model(model, peft_lora_config(cfg, model))
    except ValueError as exc:
        # PEFT says "Target modules {...} not found in the base model" for bad names.
        raise ValueError(f"lora.target_modules: {exc}") from exc


@contextmanager
def keep_lora_targets() -> Iterator[None]:
    """Within the block, PEFT puts LoRA on the modules an adapter's config names when the model has
    modules of those names.

    PEFT (0.19 and later, with transformers 5) rewrites the targets of a MoE family whose experts
    transformers 5 fused (GLM-4.5, DeepSeek-V3, Qwen3-Next, ERNIE-4.5-MoE, Hunyuan-MoE, AFMoE, ...:
    `peft.utils.transformers_weight_conversion`), so that adapters trained on transformers 4's
    per-expert modules still load: every `gate_proj`, `up_proj` and `down_proj` target becomes the
    fused experts' parameters. On these families those names are also the shared experts' and the
    dense layers' MLPs, which is what "all-linear" trains here, so the rewrite trained the experts
    instead and left the dense MLPs frozen, and a reload put the saved weights nowhere. A config
    whose every target names a module the model has needs no rewrite; others (a transformers 4
    adapter given as lora.init_adapter) still get it.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except Exception:  # a PEFT or transformers without the rewrite
        yield
        return
    original = getattr(conversion, "convert_peft_config_for_transformers", None)
    if original is None:
        yield
        return

    def convert_unless_named(peft_config, model, *args, **kwargs):
        targets = getattr(peft_config, "target_modules", None)
        if isinstance(targets, (list, set, tuple)) and targets and _all_named(model, targets):
            return None
        return original(peft_config, model, *args, **kwargs)

    # Two threads (a run attaching, the Chat page loading) may overlap here: at worst one of them
    # restores the other's wrapper, which is harmless, as every wrapper behaves alike.
    conversion.convert_peft_config_for_transformers = convert_unless_named
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _all_named(model, targets) -> bool:
    """Whether each target names (is, or ends a dotted path of) a module of `model`."""
    suffixes = set()
    for name, _ in model.named_modules():
        parts = name.split(".")
        suffixes.update(".".join(parts[-k:]) for k in range(1, len(parts) + 1))
    return all(t in suffixes for t in targets)


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]
