"""OLMo-3: OLMo-2's layer (norms after attention and the MLP, q/k RMSNorm over the whole projections)
with a sliding window on most layers (`layer_types`), carried by each attention module."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "olmo3",
    HFClasses.with_prefix("Olmo3"),
    fast_paths=True,
    qk_norm=True,
    qk_norm_width="projection",
    sliding_window="module",
    # One sliding layer with a window that cuts a test row, one full.
    tiny=dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
)
