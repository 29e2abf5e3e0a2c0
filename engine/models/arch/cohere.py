"""Cohere (Command-R) and Cohere-2 (Command-R7B, Command-A): parallel attention and MLP off one
LayerNorm (weight only), and logits multiplied by `logit_scale` (1/16 in the default config),
which every loss built on the head must see. Not patched: the layer is not Llama's."""

from engine.models.arch.spec import Arch

ARCH = Arch("cohere", aliases=("cohere2",), norm="layer", logits_times="logit_scale")
