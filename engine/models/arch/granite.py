"""Granite: Llama's modules with embedding, attention, residual and logit multipliers (not patched:
the patched attention would drop its attention multiplier); logits divided by `logits_scaling`."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch(
    "granite",
    HFClasses.with_prefix("Granite"),
    aliases=("granite_swa",),
    logits_over="logits_scaling",
    # A scaling that is not 1, so a loss that forgets it differs from the stock one.
    tiny=dict(logits_scaling=4.0),
)
