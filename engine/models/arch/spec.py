"""`Arch`: what the engine knows about one model architecture, as plain data.

Each architecture's module (engine/models/arch/<model_type>.py) holds one `ARCH`; the package
gathers them by model_type. No torch or transformers import here: the memory estimate reads these
facts from a config.json alone, before anything heavy is loaded.

The facts, by the part of the engine that reads them:

- transformers' module classes (`hf_classes`), by name: engine.models.patches finds the norms,
  attention and MLP modules it patches by these names; `fast_paths` says whether it patches at all,
  `fused_add_norm` whether its decoder layers take the fused residual-add + norm forward;
- norms: `norm` ("rms" or "layer": LayerNorm carries a bias too), `norm_offset` (Gemma scales
  by 1 + w), `extra_norms` (per-layer norms beyond the two around attention and MLP, e.g.
  Gemma-2's pre/post feed-forward norms), `qk_norm` (RMSNorm on q and k before RoPE), over each
  head (`qk_norm_width` "head", Qwen3) or the whole projection before its split into heads
  ("projection", OLMo-2/3);
- attention shape: `qkv_bias` (q/k/v biases whatever `attention_bias` says), `attention_sinks`
  (one learned sink logit per head), `sliding_window` (where the window comes from: "module",
  "config" when the module may not carry it, or "layer_type": the module's window on its sliding
  layers only, EXAONE-4), `nope_full_layers` (with a window, the full-attention layers take no
  RoPE: EXAONE-4; SmolLM3's NoPE layers say so themselves, `use_rope`), `softcapping` (logit softcap passed to the
  attention function); GQA and head_dim are config values, read from the config;
- MLP: `gated_mlp` (gate/up/down; else a plain up -> act -> down);
- packing: `row_state` (its short convolutions, state-space or linear-attention layers carry state
  along a row, so documents packed into one row would see each other: engine.train.step runs the
  decoder over each document of a packed row alone);
- output: `logits_times` / `logits_over`, the config value the head's logits are multiplied or
  divided by (Cohere's logit_scale, Granite's logits_scaling): engine.train.step scales the
  decoder's last hidden states by it, so every loss built on the head (fused or not) sees the
  logits the stock forward computes;
- MoE: `moe` (the sparse block's class, its router and expert attributes, biases, shared-expert
  gate, and whether engine.fastpath.moe groups it);
- tests: `tiny`, the config values of a tiny model of this architecture beyond `TINY_BASE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# The shape every tiny test model shares unless its architecture or the test says otherwise:
# GQA (4 query heads over 2 key/value heads), head_dim set apart from hidden / heads.
TINY_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
)


@dataclass(frozen=True)
class HFClasses:
    """transformers' class names of an architecture's modules (compared by name, never imported)."""

    norm: str
    attention: str
    mlp: str
    decoder_layer: str
    model: str
    causal_lm: str

    @classmethod
    def with_prefix(cls, prefix: str, *, norm: Optional[str] = None) -> "HFClasses":
        return cls(
            norm=norm or f"{prefix}RMSNorm",
            attention=f"{prefix}Attention",
            mlp=f"{prefix}MLP",
            decoder_layer=f"{prefix}DecoderLayer",
            model=f"{prefix}Model",
            causal_lm=f"{prefix}ForCausalLM",
        )


@dataclass(frozen=True)
class MoE:
    """The sparse (mixture-of-experts) block of an architecture."""

    block: str  # transformers' class of the sparse block
    router: str  # attribute of the block holding the router ("gate", "router")
    experts: str = "experts"  # attribute holding the experts module (3-D weight tensors)
    expert_weights: tuple[str, ...] = ("gate_up_proj", "down_proj")
    expert_bias: bool = False  # experts and router carry biases (GPT-OSS)
    shared_expert_gate: bool = False  # a sigmoid gate over the shared expert (Qwen2-MoE)
    grouped: bool = False  # engine.fastpath.moe gives this block the grouped forward


@dataclass(frozen=True)
class Arch:
    """What an architecture needs; see the module docstring for each fact's reader."""

    model_type: str
    hf_classes: Optional[HFClasses] = None
    aliases: tuple[str, ...] = ()  # other model_types with the same facts (a text-only config)
    fast_paths: bool = False  # engine.models.patches patches its norms, attention and MLP
    # Its decoder layer is one that the fused residual-add + norm layer forward of engine.models.patches
    # reproduces op for op (transformers 5.x); a new one joins once its layer is read (Granite, say,
    # scales the residual branch).
    fused_add_norm: bool = False
    norm: Literal["rms", "layer"] = "rms"
    norm_offset: float = 0.0
    extra_norms: tuple[str, ...] = ()
    qk_norm: bool = False
    qk_norm_width: Literal["head", "projection"] = "head"
    qkv_bias: bool = False
    attention_sinks: bool = False
    sliding_window: Optional[Literal["module", "config", "layer_type"]] = None
    nope_full_layers: bool = False
    softcapping: bool = False
    gated_mlp: bool = True
    moe: Optional[MoE] = None
    row_state: bool = False
    logits_times: Optional[str] = None
    logits_over: Optional[str] = None
    tiny: Optional[dict[str, Any]] = field(default=None, hash=False, compare=False)

    @property
    def norms_per_layer(self) -> int:
        return 2 + len(self.extra_norms)

    def classes(self) -> tuple[str, str, str]:
        """(norm, attention, MLP) class names, the modules engine.models.patches patches."""
        c = self.hf_classes
        if c is None:
            raise ValueError(f"{self.model_type}: no transformers classes named")
        return c.norm, c.attention, c.mlp

    def attn_kwargs(self, module: Any) -> dict:
        """The extra arguments the stock attention forward passes to the attention function."""
        kwargs: dict = {}
        if self.sliding_window is not None:
            # Qwen2/Qwen3/Gemma-2 layers carry their own window (None on full-attention layers);
            # Mistral's may not, and the config has it.
            window = getattr(module, "sliding_window", None)
            if window is None and self.sliding_window == "config":
                window = getattr(module.config, "sliding_window", None)
            if self.sliding_window == "layer_type" and not getattr(module, "is_sliding", False):
                window = None  # EXAONE-4 sets the window on every module, and uses it on sliding layers
            kwargs["sliding_window"] = window
        if self.softcapping:
            kwargs["softcap"] = getattr(module, "attn_logit_softcapping", None)
        return kwargs

    def uses_rope(self, module: Any) -> bool:
        """Whether the stock forward of this attention module rotates q and k."""
        if not getattr(module, "use_rope", True):  # SmolLM3's NoPE layers
            return False
        if self.nope_full_layers and getattr(module, "sliding_window", None) is not None:
            return bool(getattr(module, "is_sliding", False))  # EXAONE-4: global layers are NoPE
        return True

    def logit_scale(self, config: Any) -> float:
        """The factor the stock forward applies to the head's logits (1.0 for most families)."""
        scale = 1.0
        if self.logits_times is not None:
            scale *= float(getattr(config, self.logits_times, None) or 1.0)
        if self.logits_over is not None:
            scale /= float(getattr(config, self.logits_over, None) or 1.0)
        return scale

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        """Config values of a tiny random model of this architecture (`TINY_BASE`, the
        architecture's own, then `overrides`), for transformers' AutoConfig.for_model."""
        if self.tiny is None:
            raise ValueError(f"{self.model_type} has no tiny test config")
        return {**TINY_BASE, **self.tiny, **overrides}


# Unknown model types: a gated MLP, RMSNorm, no extra norms, biases only where the config says.
GENERIC = Arch("generic")
