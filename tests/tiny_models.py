"""The one factory of tiny random transformers models for tests (no weights downloaded).

`tiny_config(model_type, **overrides)` is the architecture's tiny test config from its file under
engine/models/arch/ (engine.models.arch.TINY_BASE, then the architecture's own values, then the
overrides) as a transformers config. `tiny_model(...)` builds the causal LM from it with a seed,
optionally with random norm weights, PEFT LoRA (random B, so adapters are not a no-op) and a final
dtype. Built in fp32 from the seed and cast afterwards, so a bf16 model has the fp32 model's weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from engine.models.arch import arch_for

# PEFT LoRA of the tests unless they say otherwise: rank 4 on every linear layer, no dropout.
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


# Multimodal wrappers whose language model is an architecture here (an alias of its file): built
# around that file's tiny text config, with a one-layer vision tower (the tests' prompts are text).
_WRAPPERS = {
    "gemma3": dict(
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
}


def tiny_config(model_type: str = "llama", **overrides: Any):
    """A transformers config of a tiny `model_type` model (see the module docstring); for a
    multimodal wrapper (Gemma-3's 4B and larger), the wrapper around the tiny text model, its
    image tokens the vocabulary's last three ids."""
    from transformers import AutoConfig

    arch = arch_for(model_type)
    if arch is None or arch.tiny is None:
        raise ValueError(f"no tiny test config for model_type {model_type!r} (engine/models/arch/)")
    if model_type in _WRAPPERS:
        text = tiny_config(arch.model_type, **overrides)
        v = text.vocab_size
        image_tokens = dict(boi_token_index=v - 3, eoi_token_index=v - 2, image_token_index=v - 1)
        return AutoConfig.for_model(model_type, text_config=text.to_dict(), **_WRAPPERS[model_type], **image_tokens)
    return AutoConfig.for_model(model_type, **arch.tiny_config(**overrides))


def tiny_model(
    model_type: str = "llama",
    *,
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    norm_std: Optional[float] = None,
    lora: Optional[dict] = None,
    lora_b_std: Optional[float] = None,
    config: Any = None,
    **overrides: Any,
):
    """A tiny random causal LM: `tiny_config(model_type, **overrides)` (or `config`) built under
    `torch.manual_seed(seed)` in fp32 with attention implementation `attn`, then:

    - norm_std: every norm weight drawn from N(1, std), or N(0, std) for Gemma's 1 + w norms (the
      initial all-ones / all-zeros would hide a missing or doubled scale);
    - lora: PEFT LoRA over the model, `LORA` updated with this dict ({} for the defaults);
    - lora_b_std: LoRA B drawn from N(0, std) (PEFT starts it at zero, which makes dA zero);
    - dtype: the whole model cast to it last.
    """
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    if norm_std is not None:
        arch = arch_for(cfg.model_type)
        centre = 1.0 - (arch.norm_offset if arch is not None else 0.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(centre, norm_std)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**{**LORA, **lora}))
        if lora_b_std is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, lora_b_std)
    return model.to(dtype)
