"""Qwen3: RMSNorm over head_dim on q and k before RoPE (q_norm, k_norm), a per-layer window."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "qwen3",
    HFClasses.with_prefix("Qwen3"),
    fast_paths=True,
    fused_add_norm=True,
    qk_norm=True,
    sliding_window="module",
    tiny={},
)
