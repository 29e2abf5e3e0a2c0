"""MiniCPM3: multi-head latent attention and the hidden states divided by `logits_scaling` before
the head. Not patched (its attention is not Llama's)."""

from engine.models.arch.spec import Arch

ARCH = Arch("minicpm3", logits_over="logits_scaling")
