"""Peer implementations: HF + PEFT (sdpa / flex_attention), + Liger, Unsloth, HF's MoE block."""
