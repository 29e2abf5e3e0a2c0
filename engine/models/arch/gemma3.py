"""Gemma-3: Gemma-2's layer (four (1 + w) RMSNorms, the attention's and the MLP's outputs normed
before their adds) with per-head q/k RMSNorm, alternating sliding-window layers (the window on
each module, the sliding layers' rotary table their own), no softcapping. The text model
(gemma3_text: the 1B, Gemma3ForCausalLM) and the language model inside the multimodal wrapper the
4B and larger load as (gemma3: Gemma3ForConditionalGeneration, whose vision tower keeps its own
modules) are the same modules, so both are patched."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "gemma3_text",
    HFClasses(
        norm="Gemma3RMSNorm",
        attention="Gemma3Attention",
        mlp="Gemma3MLP",
        decoder_layer="Gemma3DecoderLayer",
        model="Gemma3TextModel",
        causal_lm="Gemma3ForCausalLM",
    ),
    aliases=("gemma3",),
    fast_paths=True,
    fused_add_norm=True,
    norm_offset=1.0,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    qk_norm=True,
    sliding_window="module",
    # A sliding layer with a window that cuts a test row (and its own rotary base), then a full one.
    tiny=dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=12),
)
