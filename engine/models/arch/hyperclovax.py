"""HyperCLOVA X: Llama's layer with muP multipliers; logits multiplied by `logits_scaling` (Granite
divides by its value of the same name). Not patched: the patched attention would drop the multipliers."""

from engine.models.arch.spec import Arch

ARCH = Arch("hyperclovax", logits_times="logits_scaling")
