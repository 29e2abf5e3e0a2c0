"""OPT: a plain up -> act -> down MLP (no gate) and LayerNorm (weight and bias);
counted by the estimate only, not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("opt", norm="layer", gated_mlp=False)
