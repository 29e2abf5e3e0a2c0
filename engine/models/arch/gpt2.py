"""GPT-2: a plain up -> act -> down MLP (no gate) and LayerNorm (weight and bias);
counted by the estimate only, not patched."""

from engine.models.arch.spec import Arch

ARCH = Arch("gpt2", norm="layer", gated_mlp=False)
