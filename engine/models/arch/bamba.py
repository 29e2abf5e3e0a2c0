"""Bamba: Mamba-2 layers between attention layers. The Mamba scan runs along the whole row, so each
document of a packed row runs alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("bamba", row_state=True)
