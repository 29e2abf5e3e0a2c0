"""Qwen3-MoE: Qwen3's attention and norms; sparse blocks of frozen experts that engine.fastpath.moe
groups. Only dense layers (mlp_only_layers) are Qwen3MoeMLP modules."""

from engine.models.arch.spec import Arch, HFClasses, MoE

ARCH = Arch(
    "qwen3_moe",
    HFClasses.with_prefix("Qwen3Moe"),
    fast_paths=True,
    fused_add_norm=True,
    qk_norm=True,
    sliding_window="module",
    moe=MoE(block="Qwen3MoeSparseMoeBlock", router="gate", grouped=True),
    tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
)
