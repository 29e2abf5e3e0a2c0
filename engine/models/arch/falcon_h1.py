"""Falcon-H1: attention and Mamba-2 heads side by side in each layer, muP multipliers, logits
multiplied by `lm_head_multiplier`. Not patched (its layer is not Llama's)."""

from engine.models.arch.spec import Arch

ARCH = Arch("falcon_h1", logits_times="lm_head_multiplier")
