"""Granite-4 (granitemoehybrid): Mamba-2 layers between attention layers, Granite's multipliers (logits
divided by `logits_scaling`). The Mamba scan runs along the whole row, so each document of a packed
row runs alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("granitemoehybrid", logits_over="logits_scaling", row_state=True)
