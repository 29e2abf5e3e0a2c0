"""Mistral: Llama's layout with a sliding window that the attention module may not carry (read
from the config then)."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "mistral",
    HFClasses.with_prefix("Mistral"),
    fast_paths=True,
    fused_add_norm=True,
    sliding_window="config",
    # A small window, so that it cuts attention in a test row of a few dozen tokens.
    tiny=dict(sliding_window=8),
)
