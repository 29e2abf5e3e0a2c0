"""LFM2 (and LFM2-MoE): gated short-convolution layers between attention layers. The convolution runs
along the whole row (documents packed into one row would see the end of the one before), so each
document runs alone. Not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("lfm2", aliases=("lfm2_moe",), row_state=True)
