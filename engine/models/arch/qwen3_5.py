"""Qwen3.5 (dense and MoE; the text decoder, the vision tower is not counted): Qwen3-Next's hybrid of
gated delta-rule linear attention and full attention with q/k RMSNorm. The delta-rule layers carry
state along a row (transformers keeps packed documents apart only through flash-linear-attention,
and otherwise refuses a packed row), so each document runs alone."""

from engine.models.arch.spec import Arch

ARCH = Arch("qwen3_5", aliases=("qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), qk_norm=True, row_state=True)
