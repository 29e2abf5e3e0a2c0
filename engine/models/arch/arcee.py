"""Arcee (AFM): Llama's attention, norms and decoder layer with a plain up -> ReLU² -> down MLP (no
gate), which keeps its stock forward while the attention and norms take the fast paths."""

from engine.models.arch.spec import Arch, HFClasses

ARCH = Arch("arcee", HFClasses.with_prefix("Arcee"), fast_paths=True, fused_add_norm=True, gated_mlp=False, tiny={})
