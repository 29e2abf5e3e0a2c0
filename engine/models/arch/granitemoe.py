"""Granite-MoE (and its shared-expert and sliding-window siblings; Granite-4 has a file of its own): Granite's
multipliers, so logits divided by `logits_scaling`; routed experts of their own layout (not grouped).
Not patched: the patched attention would drop Granite's attention multiplier."""

from engine.models.arch.spec import Arch

ARCH = Arch(
    "granitemoe",
    aliases=("granitemoeshared", "granitemoe_swa"),
    logits_over="logits_scaling",
)
