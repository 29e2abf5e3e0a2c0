"""EXAONE-4: norms after attention and after the MLP (its layer keeps the stock forward), per-head q/k
RMSNorm before RoPE, and with a window configured a hybrid of sliding layers (RoPE, the window) and
global layers (no RoPE, no window). Every module carries the window; `is_sliding` says whether it
applies."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "exaone4",
    HFClasses.with_prefix("Exaone4"),
    fast_paths=True,
    qk_norm=True,
    sliding_window="layer_type",
    nope_full_layers=True,
    # One sliding layer with a window that cuts a test row, one global (NoPE) layer.
    tiny=dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
)
