"""Llama (and the Llama-shaped: SmolLM, DeepSeek-R1-Distill-Llama): RMSNorm, GQA, gated SiLU MLP."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch("llama", HFClasses.with_prefix("Llama"), fast_paths=True, fused_add_norm=True, tiny={})
