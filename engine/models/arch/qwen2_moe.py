"""Qwen2-MoE: Qwen2's biased q/k/v; routed experts plus a shared expert behind a sigmoid gate."""

from engine.models.arch.spec import Arch, MoE

ARCH = Arch(
    "qwen2_moe",
    qkv_bias=True,
    moe=MoE(block="Qwen2MoeSparseMoeBlock", router="gate", shared_expert_gate=True),
)
