"""Phi-3 / Phi-3.5 / Phi-4: fused qkv_proj and gate_up_proj (so not patched: the patches expect
separate projections); counted as a gated MLP. Its attention passes the config's sliding window
(GRPO's decode loop reads it here), and Phi-4-mini rotates part of each head (partial_rotary_factor)."""

from engine.models.arch.spec import Arch, HFClasses

# Its default pad id (32000) lies outside a tiny vocabulary.
ARCH = Arch("phi3", HFClasses.with_prefix("Phi3"), sliding_window="config", tiny=dict(pad_token_id=0))
