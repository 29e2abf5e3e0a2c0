"""Jamba: Mamba layers between attention layers, MoE on every other layer. The Mamba scan runs along
the whole row, so each document of a packed row runs alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("jamba", row_state=True)
