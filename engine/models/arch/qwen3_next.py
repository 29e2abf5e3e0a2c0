"""Qwen3-Next: per-head q/k RMSNorm as Qwen3 (its hybrid linear attention is not patched). Its gated
delta-rule layers carry state along a row (transformers keeps packed documents apart only through
flash-linear-attention, and otherwise refuses a packed row), so each document runs alone."""

from engine.models.arch.spec import Arch

ARCH = Arch("qwen3_next", qk_norm=True, row_state=True)
