"""Qwen2-VL / Qwen2.5-VL (the text decoder; the vision tower is not counted): Qwen2's biased q/k/v."""

from engine.models.arch.spec import Arch

ARCH = Arch("qwen2_vl", aliases=("qwen2_5_vl",), qkv_bias=True)
