"""Qwen2 / Qwen2.5: q/k/v always biased (o not), a per-layer sliding window on some layers."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "qwen2",
    HFClasses.with_prefix("Qwen2"),
    fast_paths=True,
    fused_add_norm=True,
    qkv_bias=True,
    sliding_window="module",
    # The config says the bias it always has; a small window on the layers after the first.
    tiny=dict(attention_bias=True, use_sliding_window=True, sliding_window=8, max_window_layers=1),
)
