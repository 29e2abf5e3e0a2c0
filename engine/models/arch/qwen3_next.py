"""Qwen3-Next: per-head q/k RMSNorm as Qwen3 (its hybrid linear attention is not patched)."""

from engine.models.arch.spec import Arch

ARCH = Arch("qwen3_next", qk_norm=True)
