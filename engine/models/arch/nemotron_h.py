"""Nemotron-H (Nemotron Nano 2 / 3): Mamba-2 layers between attention layers. Its scan runs along the
whole row, so each document of a packed row runs alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("nemotron_h", row_state=True)
