"""Qwen2-MoE: Qwen2's biased q/k/v; routed experts plus a shared expert behind a sigmoid gate
(engine.fastpath.moe does not group it: shared experts are not supported there)."""

from engine.models.arch.spec import Arch, HFClasses, MoE

ARCH = Arch(
    "qwen2_moe",
    HFClasses.with_prefix("Qwen2Moe"),
    qkv_bias=True,
    moe=MoE(block="Qwen2MoeSparseMoeBlock", router="gate", shared_expert_gate=True),
    tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
)
