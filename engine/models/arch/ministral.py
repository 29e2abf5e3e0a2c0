"""Ministral (the 8B of 2024): Mistral's layer with the sliding window on each attention module
(None on its full-attention layers, `layer_types`)."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "ministral",
    HFClasses.with_prefix("Ministral"),
    fast_paths=True,
    fused_add_norm=True,
    sliding_window="module",
    # One sliding layer with a window that cuts a test row, one full.
    tiny=dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
)
