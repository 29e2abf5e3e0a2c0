"""Gemma: RMSNorm scaled by (1 + w), a gated GELU (tanh) MLP."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch("gemma", HFClasses.with_prefix("Gemma"), fast_paths=True, fused_add_norm=True, norm_offset=1.0, tiny={})
