"""Attach LoRA adapters through PEFT, so adapters stay standard PEFT files."""

from __future__ import annotations

from engine.config import LoraConfig


def peft_lora_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        # PEFT's "all-linear" takes every linear layer of the decoder and leaves the LM head out.
        target_modules=cfg.target_modules if isinstance(cfg.target_modules, list) else "all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(model, cfg: LoraConfig):
    """Wrap `model` in a PeftModel with fresh LoRA adapters; only they require grad."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_lora_config(cfg))
    except ValueError as exc:
        # PEFT says "Target modules {...} not found in the base model" for bad names.
        raise ValueError(f"lora.target_modules: {exc}") from exc


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]
