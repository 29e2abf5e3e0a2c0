"""GPT-OSS: a learned attention-sink logit per head, alternating sliding-window layers, MoE
blocks whose experts and router carry biases (a clamped, interleaved GLU), grouped by
engine.fastpath.moe. Its attention runs the packed varlen kernel, which takes the sinks; its
norms and attention projections are not patched."""

from engine.models.arch.spec import Arch, HFClasses, MoE

ARCH = Arch(
    "gpt_oss",
    HFClasses.with_prefix("GptOss"),
    attention_sinks=True,
    sliding_window="module",
    moe=MoE(
        block="GptOssMLP",
        router="router",
        expert_weights=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        expert_bias=True,
        grouped=True,
    ),
    tiny=dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
)
