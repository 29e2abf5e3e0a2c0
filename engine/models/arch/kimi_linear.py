"""Kimi Linear: Kimi delta attention (a linear attention with short convolutions) between MLA layers.
Its recurrent state and convolutions run along the whole row, so each document of a packed row runs
alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("kimi_linear", row_state=True)
