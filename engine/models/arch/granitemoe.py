"""Granite-MoE (and its shared-expert, sliding-window and hybrid Mamba siblings, Granite-4): Granite's
multipliers, so logits divided by `logits_scaling`; routed experts of their own layout (not grouped).
Not patched: the patched attention would drop Granite's attention multiplier."""

from engine.models.arch.spec import Arch

ARCH = Arch(
    "granitemoe",
    aliases=("granitemoeshared", "granitemoe_swa", "granitemoehybrid"),
    logits_over="logits_scaling",
)
