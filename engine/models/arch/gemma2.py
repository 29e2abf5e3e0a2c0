"""Gemma-2: Gemma's (1 + w) norms plus pre/post feed-forward norms (four per layer, all RMSNorm
modules, so all patched); alternating sliding-window layers and attention-logit softcapping, both
passed to the attention function as the stock forward does."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "gemma2",
    HFClasses.with_prefix("Gemma2"),
    fast_paths=True,
    fused_add_norm=True,
    norm_offset=1.0,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    sliding_window="module",
    softcapping=True,
    # A small window that cuts a test row; softcaps low enough to bite on random weights.
    tiny=dict(sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=15.0, query_pre_attn_scalar=12),
)
