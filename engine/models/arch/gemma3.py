"""Gemma-3 (and its text-only config): Gemma-2's four norms per layer plus q/k RMSNorm (not patched);
alternating sliding-window layers (their window on each module) with a rotary table of their own."""

from engine.models.arch.spec import Arch

ARCH = Arch(
    "gemma3",
    aliases=("gemma3_text",),
    norm_offset=1.0,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    qk_norm=True,
    sliding_window="module",
)
