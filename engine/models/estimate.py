"""Model size and training-memory estimates from a transformers config alone (no weights).

`model_info(config)` counts parameters from the config's shapes (embeddings, attention with
GQA, gated MLP, MoE experts, norms, tied or untied head), with each family's facts (gated or
plain MLP, q/k/v biases, q/k norms, norms per layer, sinks, expert biases) from its file under
engine/models/arch/ (unknown families: engine.models.arch.GENERIC). `estimate_vram(...)` adds up what a
LoRA / QLoRA run keeps on the device: base weights, LoRA parameters with their gradients and
AdamW state, activations (with or without checkpointing, with or without offload and its lean
recompute: `lean_recompute_saving`), the cross-entropy chunk and a fixed overhead. `fit_verdict`
turns an estimate and a device size into "fits" / "tight" / "will not fit". The hardware defaults
policy (`engine.hardware`) uses these to choose 4-bit loading, micro-batch size and checkpointing.

The numbers are deliberately a little pessimistic: they decide defaults, and a default that
runs out of memory is worse than one that leaves some memory unused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.models.arch import GENERIC, arch_for

GiB = 1024**3
MiB = 1024**2

Mode = Literal["lora16", "qlora4", "lora32"]
MODES = ("lora16", "qlora4", "lora32")

# NF4 with double quantization (bitsandbytes, blocksize 64): 4 bits per weight, plus an 8-bit
# absmax per 64 weights, plus an fp32 scale per 256 absmax blocks.
NF4_BYTES_PER_PARAM = 0.5 + (1 + 4 / 256) / 64
# PEFT keeps adapters in fp32 (autocast_adapter_dtype): weight 4 + grad 4 + AdamW m, v 8.
LORA_BYTES_PER_PARAM = 16
# The CUDA context, cuBLAS workspaces and kernels are not in max_memory_allocated but do take
# device memory; the caching allocator fragments by several percent on top.
FIXED_OVERHEAD = 512 * MiB
FRAGMENTATION = 0.05
# Default chunk for the fused cross-entropy when the caller does not say.
DEFAULT_CE_CHUNK = 1024
# Fraction of device memory a run may plan to use before it is called "tight".
FIT_FRACTION = 0.85
# fast_paths.lean_recompute's MLP backward (engine.fastpath.lora.LoRAMLPUnread) remakes gate and up
# a row tile at a time, each [rows, intermediate] tile about this size (engine.fastpath.lora's
# UNREAD_TILE_BYTES; tests/engine/models/test_estimate_lean_recompute.py holds them equal), with at
# most this many such tiles alive at once (gate, up, dh, dgate, dup).
LEAN_TILE_BYTES = 48 * MiB
LEAN_TILES_LIVE = 5


@dataclass
class ModelInfo:
    """Shapes and parameter counts of a decoder-only model, read from its config."""

    model_type: str
    architecture: str | None
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    context_length: int | None
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # shared expert(s) of an MoE layer, summed
    num_moe_layers: int = 0
    # Parameter counts by part (elements, not bytes).
    embedding_params: int = 0
    lm_head_params: int = 0  # 0 when tied to the embeddings
    attention_params: int = 0  # all layers, with biases and q/k norms
    mlp_params: int = 0  # dense MLPs and shared experts, all layers
    expert_params: int = 0  # routed experts and routers, all layers
    norm_params: int = 0
    num_params: int = 0  # total, as stored
    active_params: int = 0  # used per token (MoE: only top-k experts)
    # Weights of nn.Linear layers inside the decoder: what 4-bit loading quantizes.
    quantizable_params: int = 0
    largest_linear_params: int = 0  # biggest single weight (dequantized on the fly in QLoRA)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def lora_params(self, r: int) -> int:
        """LoRA parameters for target_modules="all-linear" at rank r.

        Every decoder projection (q, k, v, o and the dense / shared-expert MLP) gets A [r, in]
        and B [out, r]. Routed experts stay frozen: transformers stores them as fused 3-D
        tensors, not nn.Linear, so "all-linear" does not reach them (the W5 recipe too).
        """
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = (h + q) + 2 * (h + kv) + (q + h)
        dense_layers = self.num_layers - self.num_moe_layers
        mlp_factor = 3 if (arch_for(self.model_type) or GENERIC).gated_mlp else 2  # (in + out) per projection
        dense = mlp_factor * (h + self.intermediate_size) if self.intermediate_size else 0
        shared = 3 * (h + self.shared_intermediate_size) if self.shared_intermediate_size else 0
        per_token_total = self.num_layers * attn + dense_layers * dense + self.num_moe_layers * shared
        return r * per_token_total

    def summary(self) -> str:
        def billions(n: int) -> str:
            if n >= 1e9:
                return f"{n / 1e9:.2f}B"
            return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.1f}M"

        text = (
            f"{self.model_type}: {billions(self.num_params)} parameters, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, heads {self.num_heads}/{self.num_kv_heads} (q/kv), "
            f"vocab {self.vocab_size}"
        )
        if self.is_moe:
            text += f", {self.num_experts} experts top-{self.experts_per_token} ({billions(self.active_params)} active)"
        return text


def _reader(config: Any):
    """A getter over a transformers config object or a plain config.json dict."""
    if isinstance(config, dict):
        data = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        outer = config

        def get(*names, default=None):
            for n in names:
                if data.get(n) is not None:
                    return data[n]
                if outer.get(n) is not None:
                    return outer[n]
            return default

        return get
    # Multimodal configs keep the decoder's shapes in a text sub-config.
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(*names, default=None):
        for n in names:
            for src in (text, config):
                try:
                    v = getattr(src, n, None)
                except Exception:  # Gemma-4 refuses a global read of a per-layer value: take the stored one
                    v = src.to_dict().get(n)
                if v is not None:
                    return v
        return default

    return get


def model_info(config: Any) -> ModelInfo:
    """Parameter counts and shapes from a transformers `PretrainedConfig` (or a config.json
    dict). No weights are read; vision towers of multimodal models are not counted."""
    get = _reader(config)
    model_type = str(get("model_type", default="unknown"))
    arch = arch_for(model_type) or GENERIC  # the family's facts: engine/models/arch/<model_type>.py
    archs = get("architectures")
    hidden = int(get("hidden_size", "n_embd", "d_model"))
    # Hybrid configs may give the layer count only as their list of layer kinds (Nemotron-H's
    # config.json: layers_block_type; its num_hidden_layers is a property of the config class).
    kinds = get("layer_types", "layers_block_type", "hybrid_override_pattern")
    layers = int(get("num_hidden_layers", "n_layer", "num_layers", default=len(kinds) if kinds else None))
    heads = int(get("num_attention_heads", "n_head"))
    kv_heads = int(get("num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(get("head_dim", default=hidden // heads))
    vocab = int(get("vocab_size"))
    inter = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    tied = bool(get("tie_word_embeddings", default=False))
    context = get("max_position_embeddings", "n_positions", "max_sequence_length")

    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attn_bias = bool(get("attention_bias", default=False)) or arch.qkv_bias
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if attn_bias:
        attn += q_dim + 2 * kv_dim
        if not arch.qkv_bias:  # attention_bias=True also biases o_proj
            attn += hidden
    if arch.qk_norm:
        attn += 2 * head_dim if arch.qk_norm_width == "head" else q_dim + kv_dim
    if arch.attention_sinks:  # one learned attention-sink logit per head
        attn += heads

    gated = arch.gated_mlp
    mlp_bias = bool(get("mlp_bias", default=False))

    def mlp(width: int, bias: bool = mlp_bias) -> int:
        n = (3 if gated else 2) * hidden * width
        if bias:
            n += (2 * width + hidden) if gated else (width + hidden)
        return n

    # MoE: routed experts under any of the names the families use.
    n_experts = int(get("num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    top_k = int(get("num_experts_per_tok", "num_experts_per_token", "moe_topk", default=0) or 0)
    expert_inter = int(get("moe_intermediate_size", default=0) or 0) or inter
    shared_inter = int(get("shared_expert_intermediate_size", default=0) or 0)
    n_shared = int(get("n_shared_experts", "num_shared_experts", default=0) or 0)
    if n_shared and not shared_inter:
        shared_inter = n_shared * expert_inter
    moe_layers = 0
    if n_experts:
        sparse_step = int(get("decoder_sparse_step", default=1) or 1)
        mlp_only = set(get("mlp_only_layers", default=[]) or [])
        first_dense = int(get("first_k_dense_replace", default=0) or 0)
        moe_layers = sum(
            1 for i in range(layers) if i not in mlp_only and i >= first_dense and (i + 1) % sparse_step == 0
        )

    expert_bias = arch.moe is not None and arch.moe.expert_bias  # GPT-OSS experts and router carry biases
    per_expert = mlp(expert_inter, bias=expert_bias)
    router = hidden * n_experts + (n_experts if expert_bias else 0)
    shared_gate = hidden if shared_inter and arch.moe is not None and arch.moe.shared_expert_gate else 0
    dense_layers = layers - moe_layers
    mlp_params = dense_layers * mlp(inter) + moe_layers * ((mlp(shared_inter) if shared_inter else 0) + shared_gate)
    expert_params = moe_layers * (n_experts * per_expert + router)
    active_expert_params = moe_layers * (top_k * per_expert + router)

    norms_per_layer = arch.norms_per_layer
    norm_width = hidden * (2 if arch.norm == "layer" else 1)  # LayerNorm: weight + bias
    norm_params = layers * norms_per_layer * norm_width + norm_width
    embedding = vocab * hidden
    lm_head = 0 if tied else vocab * hidden
    attention_params = layers * attn
    total = embedding + lm_head + attention_params + mlp_params + expert_params + norm_params
    active = total - expert_params + active_expert_params

    # Linear weights inside the decoder (no biases, norms or embeddings): what NF4 quantizes.
    lin_attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    lin_mlp = (3 if gated else 2) * hidden
    quantizable = (
        layers * lin_attn
        + dense_layers * lin_mlp * inter
        + moe_layers * (lin_mlp * shared_inter + n_experts * lin_mlp * expert_inter)
    )
    largest = max(
        hidden * q_dim, hidden * inter if dense_layers else 0, hidden * expert_inter * (n_experts if n_experts else 0)
    )

    return ModelInfo(
        model_type=model_type,
        architecture=archs[0] if archs else None,
        hidden_size=hidden,
        intermediate_size=inter if dense_layers else 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tied_embeddings=tied,
        context_length=int(context) if context else None,
        num_experts=n_experts,
        experts_per_token=top_k if n_experts else 0,
        expert_intermediate_size=expert_inter if n_experts else 0,
        shared_intermediate_size=shared_inter,
        num_moe_layers=moe_layers,
        embedding_params=embedding,
        lm_head_params=lm_head,
        attention_params=attention_params,
        mlp_params=mlp_params,
        expert_params=expert_params,
        norm_params=norm_params,
        num_params=total,
        active_params=active,
        quantizable_params=quantizable,
        largest_linear_params=largest,
    )


def model_info_from_path(path: str | Path) -> ModelInfo | None:
    """ModelInfo from a local model folder's config.json, or None if there is none.

    Reads the JSON directly: no transformers import, no network, no remote code.
    """
    cfg = Path(path) / "config.json"
    try:
        return model_info(json.loads(cfg.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None


@dataclass
class VramEstimate:
    """Bytes a training run keeps on the device, by part."""

    weights: int
    lora: int  # adapters + grads + AdamW state
    activations: int  # kept between forward and backward (checkpoints, or everything)
    working: int  # one layer's recompute + backward working set
    logits: int  # cross-entropy chunk (or full logits without the fused loss)
    overhead: int  # CUDA context, workspaces, allocator fragmentation

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.working + self.logits + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def estimate_breakdown(
    info: ModelInfo,
    seq_len: int,
    lora_r: int = 16,
    mode: Mode = "lora16",
    tokens_per_micro_batch: int | None = None,
    gradient_checkpointing: bool = True,
    *,
    offload: Literal["off", "single", "double"] = "off",
    ce_chunk_tokens: int | None = DEFAULT_CE_CHUNK,
    lean_recompute: bool = False,
) -> VramEstimate:
    """Memory of one LoRA training step, by part; see `estimate_vram`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    tokens = int(tokens_per_micro_batch or seq_len)
    act_bytes = 4 if mode == "lora32" else 2

    if mode == "qlora4":
        rest = info.num_params - info.quantizable_params
        # The layer being computed dequantizes its weight to 16 bits for the matmul.
        weights = int(info.quantizable_params * NF4_BYTES_PER_PARAM + rest * 2 + info.largest_linear_params * 2)
    else:
        weights = info.num_params * act_bytes
    lora = info.lora_params(lora_r) * LORA_BYTES_PER_PARAM

    h = info.hidden_size
    q_dim, kv_dim = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    if info.is_moe and info.num_moe_layers == info.num_layers:
        mlp_width = info.experts_per_token * info.expert_intermediate_size + info.shared_intermediate_size
        routing = info.num_experts * 2 + 2 * info.experts_per_token * h  # router logits, gathered rows
    else:
        mlp_width = max(info.intermediate_size, info.experts_per_token * info.expert_intermediate_size)
        routing = 0
    # Tensors one layer saves for backward, per token: norm inputs/outputs and residual
    # (4 x hidden), q/k/v and the attention output, gate / up / activation, routing buffers;
    # plus fp32 softmax statistics (log-sum-exp) per head.
    per_token_layer = act_bytes * (4 * h + 2 * q_dim + 2 * kv_dim + 3 * mlp_width + routing) + 4 * info.num_heads
    layer_full = tokens * per_token_layer
    layer_input = tokens * h * act_bytes
    if gradient_checkpointing:
        # Only each layer's input is kept; offload parks them in host memory and keeps one
        # (single buffer) or two (double buffer: one in use, one in flight) on the device.
        kept_layers = {"off": info.num_layers, "single": 1, "double": 2}[offload]
        activations = kept_layers * layer_input
    else:
        activations = info.num_layers * layer_full
    # Backward of one layer holds its saved tensors and their gradients at once.
    working = 2 * layer_full
    if lean_recompute and gradient_checkpointing and offload != "off":
        working -= lean_recompute_saving(info, tokens, mode)

    if ce_chunk_tokens:
        chunk = min(ce_chunk_tokens, tokens)
        # fp32 logits and their gradient for one chunk, plus the fp32 grad of the hidden states.
        logits = chunk * info.vocab_size * 4 * 2 + tokens * h * 4
    else:
        # Plain loss: 16-bit logits, their fp32 upcast and its gradient for every token.
        logits = tokens * info.vocab_size * (act_bytes + 4 + 4)

    subtotal = weights + lora + activations + working + logits
    overhead = FIXED_OVERHEAD + int(FRAGMENTATION * subtotal)
    return VramEstimate(
        weights=weights, lora=lora, activations=activations, working=working, logits=logits, overhead=overhead
    )


def lean_recompute_saving(info: ModelInfo, tokens: int, mode: Mode = "lora16") -> int:
    """Bytes fast_paths.lean_recompute takes off one layer's backward under offload
    (engine.fastpath.recompute): the recompute keeps neither gate nor up ([tokens, intermediate]
    each) for the backward, which remakes them and their gradients a row tile at a time. Counted
    conservatively: the two kept tensors less the tiles alive at once, nothing for the skipped
    down projection, layer output or normed inputs (Qwen3-8B at 16,384 tokens: 768 - 240 = 528 MiB,
    where the measured peak fell 0.88 GiB, 18.41 -> 17.53). A 4-bit base's backward holds the three
    MLP weights dequantized at once (engine.fastpath.lora_group.dense_4bit_once), counted against it
    in full. None for MoE layers (no dense MLP)."""
    inter = info.intermediate_size
    if info.is_moe or not inter:
        return 0
    act_bytes = 4 if mode == "lora32" else 2
    # engine.fastpath.lora._tile_rows: rows of a tile of about LEAN_TILE_BYTES, a multiple of 64.
    rows = max(64, LEAN_TILE_BYTES // (inter * act_bytes) // 64 * 64)
    kept = 2 * tokens * inter * act_bytes
    tiles = LEAN_TILES_LIVE * min(tokens, rows) * inter * act_bytes
    dense = 3 * info.hidden_size * inter * act_bytes if mode == "qlora4" else 0
    return max(0, kept - tiles - dense)


def estimate_vram(
    info: ModelInfo,
    seq_len: int,
    lora_r: int = 16,
    mode: Mode = "lora16",
    tokens_per_micro_batch: int | None = None,
    gradient_checkpointing: bool = True,
    *,
    offload: Literal["off", "single", "double"] = "off",
    ce_chunk_tokens: int | None = DEFAULT_CE_CHUNK,
    lean_recompute: bool = False,
) -> int:
    """Bytes of device memory one LoRA training step needs (peak, estimated).

    mode: "lora16" (16-bit base), "qlora4" (NF4 base, 16-bit compute) or "lora32" (fp32, the
    CPU case). tokens_per_micro_batch: tokens in one packed micro-batch (default: seq_len, one
    row). seq_len is the packed row length; attention is the varlen kind, so memory grows with
    the tokens of the micro-batch, not with seq_len squared. ce_chunk_tokens: chunk of the
    fused cross-entropy, or None for a plain loss that materializes all logits. lean_recompute:
    offload's recompute will be lean (fast_paths.lean_recompute on, a patched 16-bit dense
    model: `lean_recompute_saving`); False budgets the full recompute of a layer.
    """
    return estimate_breakdown(
        info,
        seq_len,
        lora_r,
        mode,
        tokens_per_micro_batch,
        gradient_checkpointing,
        offload=offload,
        ce_chunk_tokens=ce_chunk_tokens,
        lean_recompute=lean_recompute,
    ).total


def fit_verdict(estimate: int, total_vram: int) -> Literal["fits", "tight", "will not fit"]:
    """ "fits" within 85% of the device, "tight" up to all of it, else "will not fit"."""
    if total_vram <= 0:
        return "will not fit"
    if estimate <= FIT_FRACTION * total_vram:
        return "fits"
    if estimate <= total_vram:
        return "tight"
    return "will not fit"
