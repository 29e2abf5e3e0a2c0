"""Batched sampling with a preallocated KV cache over the patched layers: GRPO's decode loop.

transformers' `generate` spends its time on the host, not the GPU: one decoding step of 64
sequences on Qwen3-1.7B (28 layers) took ~86 ms on the H200 for a few ms of GPU work. Per layer
and token it ran PEFT's LoRA Linear forwards (a cast, dropout, A, B, scale and add for each of
q/k/v/o), the stock attention with transformers' cache API (a `torch.cat` of the growing cache
per layer), and per token a 4-D mask, the model-kwargs bookkeeping and the stopping criteria.
On a tiny CPU Qwen3 that is ~410 aten ops per layer per token.

`decode(...)` runs the same model through its own loop instead:

- the KV cache is allocated once at its final length ([B, kv heads, prompt + max_new, head_dim]
  per layer, rounded up to 16 slots) and each step writes one slot (`index_copy_` at a slot
  held on the device; nothing grows);
- each layer reuses the fast paths the training forward takes (engine.models.patches' plans):
  the fused LoRA q/k/v and o (`lora_linears`, adapter weights cached per optimizer step), the
  RMSNorm and add+RMSNorm kernels, RoPE, and the patched MLP module; attention is one
  `scaled_dot_product_attention` over the whole cache under a key mask, the query heads of
  each key/value head laid out as the query length (grouped-query attention with no repeated
  K/V);
- the rotary cos/sin of every generated position are computed once, and the key mask is one
  [B, 1, 1, slots] boolean buffer, one slot switched on per step (no per-token mask building);
  a sliding-window layer reads it through a band of its window's slots, made on the device
  from the step's slot (once per window a step). The loop builds its masks itself, so no prompt
  reads its left padding (the packed attention function gets no padding mask:
  engine.fastpath.attention.unpacked_attention);
- what a family's layers do beyond the plain pre-norm decoder is repeated op for op, as its
  stock forwards do it: attention sinks (GPT-OSS: a learned logit per head, one more score
  column that takes part in the softmax and is dropped before the values are read), Gemma-2's
  attention-logit and head softcaps, Gemma-2's and Gemma-3's sandwich norms, Gemma-3's rotary
  table per layer type (its sliding layers have their own base), OLMo-2/3's and EXAONE-4's norms
  after the attention and MLP instead of before, OLMo's q/k norms over the whole projection,
  Granite's multipliers (embeddings, each residual branch, the logits' scaling). Gemma-3's 4B and
  larger load as a multimodal wrapper; its language model samples text prompts here;
- the logits are the last position's only; sampling is transformers' own arithmetic, op for
  op (temperature divide, its top-p warper, softmax, one `torch.multinomial` over all rows),
  so a seed gives the same completions as `generate` did;
- the host reads nothing back per token: whether every row has ended is checked every
  `STOP_CHECK_EVERY` steps (one sync each), and the tokens come back in one copy at the end;
  the draws made after the last row ended are taken back (the generator's state is kept for
  each step since the last check), so the RNG then stands where `generate` left it.

Finished rows keep decoding (their input is the pad token, as in `generate`) until the next
check: dropping them would change the shape of the one multinomial draw per step, so every
later row's samples would change with the seed, and a fixed batch shape is what a captured
(CUDA-graph) step would need. On a host-bound GPU a finished row costs nothing measurable.

A layer the fast paths left alone (a CPU run, where the policy turns them off) runs its stock
modules the same way: PEFT's projections, the stock norms, the torch rotation.

`decode_refusal(model, total_len)` says why a model cannot take this loop (an architecture
outside DECODE_ARCHS; attention both ways; attention arguments beyond a sliding window and a
softcap; norms beyond the layer shapes above; dynamic or longrope rotary tables past the
length where they change); the caller counts the reason (engine.counters'
`fallback:decode_loop: <reason>`, in the step's report) and uses `generate`, as it does for a
sharded (FSDP) model. NoPE layers (SmolLM3's, Arch.uses_rope) skip the rotation here as in the
training forward; q/k norms over each head (Qwen3) are applied.

The step is captured as a CUDA graph where `graph_refusal` allows (not for 4-bit bases or
expert routing); the graph is recorded once per call, as the adapters change every step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from engine.fastpath import patching
from engine.fastpath.lora import lora_linears
from engine.kernels.rope import rope_reference

# engine.models.patches' kind of installed forward (engine.fastpath.patching): the plans read here.
PATCH_KIND = "patches"

# Steps between the host's checks that every row has ended: each check is one device-to-host
# sync; at most this many - 1 steps run after the last row ended (their tokens are cut).
STOP_CHECK_EVERY = 8


# The architectures whose model and layer forwards this loop repeats (the pre-norm decoder and
# the variants in the module docstring), each checked against `generate` for a seed
# (tests/engine/train/test_grpo_decoding.py). Others keep `generate`.
DECODE_ARCHS = frozenset(
    {
        "arcee",
        "exaone4",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt_oss",
        "granite",
        "llama",
        "mistral",
        "ministral",
        "olmo2",
        "olmo3",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "starcoder2",
    }
)

# The per-layer norms beyond the two around attention that the loop applies: Gemma-2's and
# Gemma-3's sandwich (the attention's output normed before the add, the MLP's input and output each normed).
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")

# The families whose rotary module gives half-width tables that multiply each half of q and k
# (`_full_width`); a narrower table elsewhere rotates only the first dims (Phi-3's partial rotary).
HALF_WIDTH_ROPE = frozenset({"gpt_oss"})

# transformers' rope types whose rotary module recomputes its frequencies as the sequence grows.
SEQUENCE_LENGTH_ROPE = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True)
class _StockAttention:
    """What the loop reads of an attention module the fast paths left alone: engine.models.
    patches' plan fields, filled for the stock projections, norms and the torch rotation."""

    qk_norm: bool
    attn_kwargs: Callable
    use_rope: bool  # Arch.uses_rope: False on NoPE layers (SmolLM3's)
    qk_norm_projection: bool  # OLMo's q/k norms over the whole projection, before the split into heads
    qkv: None = None
    o: None = None
    rope: None = None
    rope_always_inplace: bool = False


class _Layers:
    """What the loop reads of a (PEFT-wrapped) causal LM, resolved once per call."""

    def __init__(self, model):
        from engine.models.arch import arch_for
        from engine.models.patches import hf_model

        self.hf = hf_model(model)
        arch = arch_for(self.hf.config.model_type)
        self.decoder = self.hf.get_decoder()
        self.layers = list(self.decoder.layers)
        self.attn_plans = [_attn_plan(layer, arch) for layer in self.layers]
        self.layer_plans = [patching.installed(layer, PATCH_KIND) for layer in self.layers]
        # Each layer's sliding window in tokens and Gemma-2's attention-logit softcap (None: none),
        # as its stock forward passes them to the attention.
        kwargs = [plan.attn_kwargs(layer.self_attn) for plan, layer in zip(self.attn_plans, self.layers)]
        self.windows = [k.get("sliding_window") for k in kwargs]
        self.softcaps = [k.get("softcap") for k in kwargs]
        self.sandwich = [all(hasattr(layer, name) for name in SANDWICH_NORMS) for layer in self.layers]
        self.post_norm = [_post_norm(layer) for layer in self.layers]
        # Granite's multipliers, as its forwards apply them: the embeddings', each layer's residual branch's.
        self.embedding_multiplier = getattr(self.decoder, "embedding_multiplier", None)
        self.residual_multipliers = [getattr(layer, "residual_multiplier", None) for layer in self.layers]
        # The head's logits times or over a config value (Arch.logits_times / logits_over: Granite's logits_scaling).
        text = _text_config(self.hf)
        self.logits_times = getattr(text, arch.logits_times) if arch.logits_times else None
        self.logits_over = getattr(text, arch.logits_over) if arch.logits_over else None
        self.final_softcap = getattr(text, "final_logit_softcapping", None)  # Gemma-2's head
        # Each layer's rotary table: Gemma-3's rotary module keeps one per layer type (the sliding
        # layers' own base frequency) and takes the type; others have one table (key None).
        rotary = self.decoder.rotary_emb
        types = getattr(text, "layer_types", None)
        by_type = types is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.rope_keys = [types[i] if by_type else None for i in range(len(self.layers))]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input for `ids`, as its forward makes it (Granite multiplies the lookup)."""
        h = self.decoder.embed_tokens(ids)
        return h if self.embedding_multiplier is None else h * self.embedding_multiplier

    def rope_tables(self, probe: torch.Tensor, positions: torch.Tensor) -> dict:
        """{rope key: (cos, sin)} at the head's width for `positions` [B, T] (`_full_width`)."""
        rotary = self.decoder.rotary_emb
        tables = {}
        for key in dict.fromkeys(self.rope_keys):
            cos, sin = rotary(probe, positions) if key is None else rotary(probe, positions, key)
            tables[key] = _full_width(self, cos, sin)
        return tables


def _text_config(hf):
    """The config of the language model: a multimodal wrapper's (Gemma-3's 4B and larger load as
    Gemma3ForConditionalGeneration, whose decoder is its language model) keeps it in text_config."""
    return hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config


def _post_norm(layer) -> bool:
    """OLMo-2/3's and EXAONE-4's layer: no norm before the attention or the MLP, their outputs
    normed before each add (post_attention_layernorm, post_feedforward_layernorm)."""
    return not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def _attn_plan(layer, arch):
    """The attention's patch plan, or the stock module's equivalent."""
    patch = patching.installed(layer.self_attn, PATCH_KIND)
    if patch is None:
        projection = arch.qk_norm and arch.qk_norm_width == "projection"
        return _StockAttention(arch.qk_norm, arch.attn_kwargs, arch.uses_rope(layer.self_attn), projection)
    return patch.plan


def _rope_fixed_length(rotary, layer_type) -> int:
    """The longest sequence for which a dynamic or longrope rotary module keeps its original
    frequencies (transformers' dynamic_rope_update switches past it). Where versions read the
    length from different places, the shortest of them: refusing early costs speed, not results."""
    config = rotary.config
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    candidates = [getattr(rotary, "original_max_seq_len", None), params.get("original_max_position_embeddings")]
    candidates.append(getattr(config, "original_max_position_embeddings", None))
    return min(int(c) for c in candidates if c)


def decode_refusal(model, total_len: int) -> Optional[str]:
    """None when `decode` can run `model` for sequences of up to `total_len` tokens, else why not
    (a rotary table that changes with the length refuses only past the length where it would)."""
    from engine.models.arch import arch_for
    from engine.models.patches import hf_model

    hf = hf_model(model)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    arch = arch_for(model_type)
    if model_type not in DECODE_ARCHS or arch is None:
        return f"model_type {model_type!r} is not one the decode loop repeats"
    # The per-layer facts the loop does not repeat (none of DECODE_ARCHS has them today): refused,
    # so a family added to the list with one of them keeps generate until the loop learns it.
    if arch.extra_norms and tuple(arch.extra_norms) != SANDWICH_NORMS:
        return f"its layers have norms beyond the ones the loop applies ({', '.join(arch.extra_norms)})"
    text = _text_config(hf)
    if getattr(text, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    try:
        decoder = hf.get_decoder()
        layers = list(decoder.layers)
    except (AttributeError, TypeError):
        return "the model has no decoder layers the loop knows"
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name}"
    if getattr(hf, "lm_head", None) is None:
        return "the model has no lm_head"
    rotary = decoder.rotary_emb
    rope_types = getattr(rotary, "rope_type", "default")
    # One type, or (Gemma-3) one per layer type.
    by_type = rope_types.items() if isinstance(rope_types, dict) else ((None, rope_types),)
    for layer_type, rope_type in by_type:
        if rope_type not in SEQUENCE_LENGTH_ROPE:
            continue
        # The loop computes every generated position's rotation at once, at the final length;
        # generate's module switches its frequencies token by token once the sequence passes the
        # original context. Up to that length both use the original table, exactly.
        limit = _rope_fixed_length(rotary, layer_type)
        if total_len > limit:
            # (The length reached is left out: the reason is a counter's key, one per cause.)
            return f"its rotary tables change with the sequence length (rope_type {rope_type!r}) past {limit} tokens"
    for i, layer in enumerate(layers):
        norms = ("post_feedforward_layernorm",) if _post_norm(layer) else ("input_layernorm",)
        for name in (*norms, "self_attn", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                return f"layer {i} has no {name}"
        extra = _attn_plan(layer, arch).attn_kwargs(layer.self_attn)
        extra.pop("sliding_window", None)  # the loop applies it (_windowed)
        extra.pop("softcap", None)  # and this (_softcap_attention)
        extra = {k: v for k, v in extra.items() if v is not None}
        if extra:
            return f"layer {i}'s attention takes {', '.join(sorted(extra))}"
    return None


class _Cache:
    """One layer's K and V [B, kv heads, slots, head_dim], allocated at the first write (in the
    dtype the layer's projections give) and zeroed: a masked slot must hold no NaN (a zero
    attention weight times NaN is NaN)."""

    __slots__ = ("k", "v", "slots")

    def __init__(self, slots: int):
        self.k = self.v = None
        self.slots = slots

    def write(self, k: torch.Tensor, v: torch.Tensor, at):
        """k, v [B, T, kv heads, D] into the slots from `at`; what the attention reads. `at` an
        int (the prompt: slots 0..T-1, and the cache up to there) or a device tensor [1] (one
        decoding step: that slot, and the whole cache; the key mask hides the rest)."""
        if self.k is None:
            b, _, heads, d = k.shape
            self.k = torch.zeros(b, heads, self.slots, d, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(b, heads, self.slots, d, dtype=v.dtype, device=v.device)
        if isinstance(at, int):
            end = at + k.shape[1]
            self.k[:, :, at:end].copy_(k.transpose(1, 2))
            self.v[:, :, at:end].copy_(v.transpose(1, 2))
            return self.k[:, :, :end], self.v[:, :, :end]
        self.k.index_copy_(2, at, k.transpose(1, 2))
        self.v.index_copy_(2, at, v.transpose(1, 2))
        return self.k, self.v


def _windowed(mask: torch.Tensor, at, window: int) -> torch.Tensor:
    """`mask` [B, 1, T, keys] narrowed to a sliding window: a query at slot i reads key slot j
    only where i - j < window, transformers' sliding-window rule over cache positions (the loop's
    slots are generate's: both pad prompts on the left to the same width). `at` as in
    _Cache.write: the first query's slot (int), or the step's slot on the device ([1])."""
    t, keys = mask.shape[-2:]
    key_slots = torch.arange(keys, device=mask.device)
    query_slots = at + torch.arange(t, device=mask.device) if isinstance(at, int) else at
    return mask & (key_slots > query_slots[:, None] - window)


def _sink_attention(attn, qg, keys, values, mask, t):
    """transformers' eager attention with sinks (GPT-OSS's `eager_attention_forward`), op for op,
    on the loop's grouped layout: qg [B, kv, g*T, D], mask [B, 1, g*T, keys]. The sink logit of
    query head kv*g + i is one more score column of that head's T rows; it takes part in the
    softmax and is dropped before the values are read."""
    b, kv_heads, rows, _ = qg.shape
    scores = torch.matmul(qg, keys.transpose(2, 3)) * attn.scaling
    # eager adds a mask of 0 and the dtype's lowest value; where that is added the softmax gives
    # 0, as it does for the lowest value written in.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    g = rows // t
    sinks = attn.sinks.view(1, kv_heads, g, 1, 1).expand(b, kv_heads, g, t, 1).reshape(b, kv_heads, rows, 1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def _softcap_attention(attn, qg, keys, values, mask, softcap):
    """transformers' eager attention with a logit softcap (Gemma-2's `eager_attention_forward`),
    op for op, on the loop's grouped layout (as `_sink_attention`): the scores capped by
    softcap * tanh(scores / softcap), then masked, a float32 softmax cast back, the values read."""
    scores = torch.matmul(qg, keys.transpose(2, 3)) * attn.scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)
    return torch.matmul(probs, values)


def _split_qkv(attn, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of a fused projection's output (Phi-3's qkv_proj): query heads, then K, then V."""
    q_end = attn.config.num_attention_heads * attn.head_dim
    k_end = q_end + attn.num_key_value_heads * attn.head_dim
    return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]


def _rotate(q, k, cos, sin):
    """transformers' rotation on [B, T, H, D]; a table narrower than the head (Phi-3's
    partial_rotary_factor) rotates the first dims and passes the rest, op for op as its forward."""
    width = cos.shape[-1]
    if width == q.shape[-1]:
        return rope_reference(q, k, cos, sin)
    q_rot, k_rot = rope_reference(q[..., :width], k[..., :width], cos, sin)
    return torch.cat([q_rot, q[..., width:]], dim=-1), torch.cat([k_rot, k[..., width:]], dim=-1)


def _attention(attn, plan, h, cos, sin, use_rope, cache, at, mask, softcap=None):
    """One layer's attention for h [B, T, hidden], writing its K/V at `at` (_Cache.write); the
    steps of engine.models.patches' attention forward up to the attention call."""
    b, t, _ = h.shape
    shape = (b, t, -1, attn.head_dim)
    if plan.qkv is not None and plan.qkv.runtime_ok(h):
        q, k, v = lora_linears(h, plan.qkv)
    elif hasattr(attn, "qkv_proj"):  # Phi-3's one projection, split as its forward splits it
        q, k, v = _split_qkv(attn, attn.qkv_proj(h))
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if plan.qk_norm_projection:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if plan.qk_norm and not plan.qk_norm_projection:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if use_rope:
        if plan.rope is None:
            q, k = _rotate(q, k, cos, sin)
        else:
            if plan.qk_norm and (plan.rope_always_inplace or q.is_cuda):
                q = q.clone() if q._is_view() else q.contiguous()
                k = k.clone() if k._is_view() else k.contiguous()
            q, k = plan.rope(q, k, cos, sin)
    keys, values = cache.write(k, v, at)
    kv_heads, end, d = keys.shape[1:]
    g = q.shape[2] // kv_heads
    # [B, T, kv, g, D] -> [B, kv, g*T, D]: each K/V head's query heads as its query rows, so the
    # attention reads the cache once per K/V head (no repeat_kv copy); a view when T == 1.
    qg = q.reshape(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
    m = mask.unsqueeze(2).expand(b, 1, g, t, end).reshape(b, 1, g * t, end)
    if getattr(attn, "sinks", None) is not None:
        out = _sink_attention(attn, qg, keys, values, m, t)
    elif softcap is not None:
        out = _softcap_attention(attn, qg, keys, values, m, softcap)
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m, scale=attn.scaling)
    out = out.view(b, kv_heads, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, kv_heads * g * d)
    if plan.o is not None and plan.o.runtime_ok(out):
        (out,) = lora_linears(out, plan.o)
    else:
        out = attn.o_proj(out)
    return out


def _layer(layer, plan, lplan, sandwich, post_norm, scale, softcap, h, cos, sin, cache, at, mask):
    """One decoder layer (engine.models.patches' fused layer, with the cache); `scale` Granite's
    residual multiplier, `softcap` Gemma-2's attention-logit cap (None elsewhere)."""
    attn = layer.self_attn
    if post_norm:  # OLMo-2/3's, EXAONE-4's layer, op for op
        a = _attention(attn, plan, h, cos, sin, plan.use_rope, cache, at, mask, softcap)
        h = h + layer.post_attention_layernorm(a)
        return h + layer.post_feedforward_layernorm(layer.mlp(h))
    residual = h
    x = layer.input_layernorm(h)
    a = _attention(attn, plan, x, cos, sin, plan.use_rope, cache, at, mask, softcap)
    if scale is not None:  # Granite's layer, op for op
        h = residual + a * scale
        return h + layer.mlp(layer.post_attention_layernorm(h)) * scale
    if sandwich:  # Gemma-2's and Gemma-3's layer, op for op
        h = residual + layer.post_attention_layernorm(a)
        m = layer.mlp(layer.pre_feedforward_layernorm(h))
        return h + layer.post_feedforward_layernorm(m)
    norm = layer.post_attention_layernorm
    fused = lplan is not None and a.dtype == residual.dtype
    fused = fused and (lplan.plan.offset != 0.0 or norm.weight.dtype == a.dtype)
    if fused:
        p = lplan.plan
        x, residual = p.fn(a, residual, norm.weight, getattr(norm, p.eps_attr), p.offset)
    else:
        residual = residual + a
        x = norm(residual)
    m = layer.mlp(x)
    if isinstance(m, tuple):  # MoE blocks of some versions return (hidden, router logits)
        m = m[0]
    return residual + m


def _layers(net: _Layers, h, rope: dict, caches, at, mask):
    """The decoder layers over embeddings h [B, T, hidden], K/V written at `at` (_Cache.write);
    `rope` {rope key: (cos, sin)} (`_Layers.rope_tables`); `mask` [B, 1, T, keys] the
    full-attention layers' (each window's made from it once)."""
    masks = {None: mask}
    for i, (layer, cache, window) in enumerate(zip(net.layers, caches, net.windows)):
        if window not in masks:
            masks[window] = _windowed(mask, at, window)
        cos, sin = rope[net.rope_keys[i]]
        plans = (net.attn_plans[i], net.layer_plans[i], net.sandwich[i], net.post_norm[i])
        plans += (net.residual_multipliers[i], net.softcaps[i])
        h = _layer(layer, *plans, h, cos, sin, cache, at, masks[window])
    return h


def _logits(net: _Layers, h) -> torch.Tensor:
    """The last position's fp32 logits [B, V] (as generate takes them) of the layers' output.
    Outside any captured graph, as the embedding lookup: either may live in host memory
    (engine.fastpath.host_embed, host_head), which reads or copies on the host."""
    h = net.decoder.norm(h[:, -1:])
    logits = net.hf.lm_head(h)
    if net.logits_times is not None:
        logits = logits * net.logits_times
    if net.logits_over is not None:
        logits = logits / net.logits_over
    if net.final_softcap is not None:  # Gemma-2's head, op for op
        logits = torch.tanh(logits / net.final_softcap) * net.final_softcap
    return logits[:, -1].to(dtype=torch.float32)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    # transformers' TopPLogitsWarper (min_tokens_to_keep=1), op for op: the same draws.
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = 0
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, -float("inf"))


def _next_tokens(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float) -> torch.Tensor:
    """transformers' token selection (its `_sample` with the warpers `generate` adds for these
    settings and top_k=0)."""
    if greedy:
        return torch.argmax(logits, dim=-1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        logits = _top_p(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


class _RNGTrail:
    """The sampling generator's state before each draw since the last stop check, so the draws
    made after every row had ended (up to STOP_CHECK_EVERY - 1 of them) can be taken back:
    the RNG then moves on exactly as under `generate`, which stopped at that step, and a run's
    later samples stay the same for a seed. Reading the state is a host copy, no device sync
    (CUDA's is a seed and an offset)."""

    def __init__(self, device, keep: bool):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.keep = keep
        self.states: dict[int, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def before_draw(self, step: int) -> None:
        if self.keep:
            self.states[step] = self._get()

    def forget(self) -> None:
        self.states.clear()

    def rewind_to(self, step: int) -> None:
        """The state before `step`'s draw back, when that draw was made."""
        state = self.states.get(step)
        if state is None:
            return
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


class _Step:
    """The decoder layers of one decoding step with static inputs: the embeddings [B, 1, hidden],
    the slot [1], the rotary rows [B, 1, D] and the key mask [B, 1, 1, slots] live in buffers
    the loop fills, so the step's launches are the same every time and, on CUDA, are captured
    once as a graph and replayed (the host's per-token work then is the embedding lookup, a few
    copies, the head and the sampling)."""

    def __init__(self, net, caches, n, slots, hidden, rope_dims: dict, dtype, device):
        self.net, self.caches = net, caches
        self.h = torch.zeros(n, 1, hidden, dtype=dtype, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        # {rope key: (cos, sin)}, one pair per table the layers read (_Layers.rope_keys).
        self.rope = {
            key: tuple(torch.zeros(n, 1, dim, dtype=dtype, device=device) for _ in range(2))
            for key, dim in rope_dims.items()
        }
        self.mask = torch.zeros(n, 1, 1, slots, dtype=torch.bool, device=device)
        self.graph = None
        self.out = None

    def eager(self) -> torch.Tensor:
        return _layers(self.net, self.h, self.rope, self.caches, self.slot, self.mask)

    def capture(self) -> Optional[str]:
        """Record the step as a CUDA graph (its buffers hold a real step's inputs; capturing
        runs nothing); None, or why it stays eager. Call after one eager step (Triton's
        compiles, cuBLAS's workspaces)."""
        from engine.train.step_graph import SyncWatch

        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        watch = SyncWatch()
        try:
            # thread_local: another thread's CUDA calls (the window's) do not spoil the capture.
            with watch, torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.eager()
        except RuntimeError as exc:  # an op that syncs or is not capturable: the eager step
            torch.cuda.synchronize()
            return f"capture failed: {str(exc).splitlines()[0][:160]}{watch.where(exc)}"
        self.graph, self.out = graph, out
        return None

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.eager()
        self.graph.replay()
        return self.out


def _full_width(net: _Layers, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables at the head's width. GPT-OSS's rotary module gives half-width tables and
    its rotation multiplies each half of q and k by them (x1*cos - x2*sin, x2*cos + x1*sin): the
    same numbers, op for op, as the usual rotate_half rotation with each table written twice."""
    if net.hf.config.model_type in HALF_WIDTH_ROPE and cos.shape[-1] * 2 == net.layers[0].self_attn.head_dim:
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos, sin


def graph_refusal(model, device) -> Optional[str]:
    """None when `decode` may capture its step as a CUDA graph on `device`, else why not."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    from engine.models.arch import arch_for
    from engine.models.patches import hf_model

    hf = hf_model(model)
    arch = arch_for(getattr(hf.config, "model_type", None))
    if arch is not None and arch.moe is not None:
        return "the expert routing reads counts on the host"
    for module in hf.modules():
        if "4bit" in type(module).__name__ or "8bit" in type(module).__name__:
            return f"a quantized layer ({type(module).__name__}) is not known capturable"
    return None


def decode(
    model,
    prompts,
    group_size,
    max_new_tokens,
    temperature,
    top_p,
    eos_ids,
    pad_id,
    device,
    greedy=False,
    graphs: bool | None = None,
    report: dict | None = None,
) -> list[list[int]]:
    """[len(prompts) * group_size] lists of max_new_tokens generated ids (each group's
    consecutive; rows that ended early hold pad ids after their end, possibly fewer tokens
    when every row ended before max_new_tokens). `graphs`: capture the step as a CUDA graph
    (None: where `graph_refusal` is None); `report["graph"]` then says "on" or why not. Call
    with the model in eval mode, no autograd, and `decode_refusal` None."""
    net = _Layers(model)
    n = len(prompts) * group_size
    width = max(map(len, prompts))
    # Slots rounded up to 16: an attention mask's rows aligned as the fused kernels want them.
    slots = -(-(width + max_new_tokens) // 16) * 16
    rows = [p for p in prompts for _ in range(group_size)]  # generate's repeat_interleave order
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in rows], device=device)
    prompt_mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in rows], device=device)
    # Positions as generate counts them: the mask's cumsum - 1 (1 on padding), then onwards.
    positions = prompt_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(~prompt_mask, 1)
    gen_positions = positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)
    # The prompt's queries read its own earlier tokens and (so no padding query row is all
    # masked, whose NaN would reach the cache) themselves.
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    prefill_mask = ((causal & prompt_mask[:, None, :]) | eye)[:, None]

    # The rotary tables in the embeddings' dtype (what the stock model passes its rotary module).
    probe = torch.empty(1, dtype=net.decoder.embed_tokens.weight.dtype, device=device)
    rope_p = net.rope_tables(probe, positions)
    # Each generated step's [B, 1, D] rows contiguous (the RoPE kernel's layout): [steps, B, 1, D].
    rope_g = {
        key: tuple(t.transpose(0, 1).unsqueeze(2).contiguous() for t in pair)
        for key, pair in net.rope_tables(probe, gen_positions).items()
    }
    caches = [_Cache(slots) for _ in net.layers]
    h = net.embed(ids)
    dims = {key: cos.shape[-1] for key, (cos, _) in rope_g.items()}
    step_fn = _Step(net, caches, n, slots, h.shape[-1], dims, h.dtype, device)
    step_fn.mask[:, 0, 0, :width] = prompt_mask
    refusal = graph_refusal(model, device) if graphs is None else (None if graphs else "not asked for")

    out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(eos_ids), device=device)
    unfinished = torch.ones(n, dtype=torch.long, device=device)
    logits = _logits(net, _layers(net, h, rope_p, caches, 0, prefill_mask))
    done = max_new_tokens
    rng = _RNGTrail(device, keep=not greedy)
    for step in range(max_new_tokens):
        rng.before_draw(step)
        nxt = _next_tokens(logits, greedy, temperature, top_p)
        nxt = nxt * unfinished + pad_id * (1 - unfinished)
        out[:, step] = nxt
        unfinished = unfinished & ~torch.isin(nxt, eos)
        if step + 1 == max_new_tokens:
            break
        if (step + 1) % STOP_CHECK_EVERY == 0:
            if not bool(unfinished.any()):
                # Every row ended at or before this step: generate stopped at the step the last
                # one ended; the draws after it are taken back, so the RNG moves on as there.
                last = int(torch.isin(out[:, : step + 1], eos).int().argmax(1).max())
                rng.rewind_to(last + 1)
                done = last + 1
                break
            rng.forget()
        # The step's inputs into the buffers (copies on the device; the host reads nothing).
        slot = width + step
        step_fn.h.copy_(net.embed(nxt[:, None]))
        step_fn.slot.fill_(slot)
        for key, (cos, sin) in step_fn.rope.items():
            cos.copy_(rope_g[key][0][step])
            sin.copy_(rope_g[key][1][step])
        step_fn.mask[:, :, :, slot] = True
        if refusal is None and step == 1:  # step 0 ran eagerly: kernels compiled, workspaces made
            refusal = step_fn.capture()
        logits = _logits(net, step_fn())
    if report is not None:
        captured = refusal is None and step_fn.graph is not None
        report["graph"] = "on" if captured else f"off: {refusal or 'too few steps'}"
    return out[:, :done].tolist()
