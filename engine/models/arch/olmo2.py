"""OLMo-2: norms after attention and after the MLP (post_attention_layernorm, post_feedforward_layernorm;
none before them, so its layer keeps the stock forward) and q/k RMSNorm over the whole q and k
projections before they are split into heads."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "olmo2",
    HFClasses.with_prefix("Olmo2"),
    fast_paths=True,
    qk_norm=True,
    qk_norm_width="projection",
    tiny={},
)
