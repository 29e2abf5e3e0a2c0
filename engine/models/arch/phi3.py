"""Phi-3 / Phi-3.5 / Phi-4: fused qkv_proj and gate_up_proj (so not patched: the patches expect
separate projections); counted as a gated MLP."""

from engine.models.arch.spec import Arch, HFClasses

# Its default pad id (32000) lies outside a tiny vocabulary.
ARCH = Arch("phi3", HFClasses.with_prefix("Phi3"), tiny=dict(pad_token_id=0))
