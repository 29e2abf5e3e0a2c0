"""Cohere (Command-R), Cohere-2 (Command-R7B, Command-A) and Cohere-2 MoE: parallel attention and
MLP off one LayerNorm (weight only; Cohere-2 MoE may take an RMSNorm), and logits multiplied by
`logit_scale` (1/16 in the default config), which every loss built on the head must see. Not
patched: the layer is not Llama's."""

from engine.models.arch.spec import Arch

ARCH = Arch("cohere", aliases=("cohere2", "cohere2_moe"), norm="layer", logits_times="logit_scale")
