"""Granite: Llama's modules with embedding, attention, residual and logit multipliers (not patched:
the patched attention would drop its attention multiplier)."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch("granite", HFClasses.with_prefix("Granite"), tiny={})
