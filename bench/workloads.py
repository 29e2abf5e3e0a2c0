"""The reference workloads of WORKLOADS.md as data, plus model building from their configs.

Every model is built from a config with random weights (the GPU host has no weights and
cannot download any); speed does not depend on the values. `matmul_params` gives N for the
6N-FLOPs ceiling: parameters in matmuls including the LM head, attention scores aside.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PEAK_FLOPS = 790e12  # measured bf16 matmul rate of the H200 (WORKLOADS.md)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Workload:
    id: str
    title: str
    arch: str  # transformers model_type: "qwen3", "llama", "qwen3_moe", "gpt_oss"
    config: dict[str, Any]
    kind: str = "train"  # "train" (full LoRA step), "moe_block" (W5), "memcap" (W7), "dpo" (W10), "grpo" (W11)
    tokens: int = 16_384  # tokens per step (W7: the search's upper end is separate)
    packing: str = "packed"  # "packed": LogNormal documents; "single": one document per step
    quant: str | None = None  # "nf4" for QLoRA workloads
    lora_targets: tuple[str, ...] = ALL_LINEAR
    target: str = ""  # the WORKLOADS.md target, for reports
    extra: dict[str, Any] = field(default_factory=dict)

    def with_changes(self, **changes) -> "Workload":
        return dataclasses.replace(self, **changes)


_QWEN3_COMMON = dict(
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40_960, hidden_act="silu", attention_bias=False
)
_LLAMA_COMMON = dict(
    rms_norm_eps=1e-5, max_position_embeddings=131_072, hidden_act="silu", attention_bias=False, mlp_bias=False
)

# Qwen3-30B-A3B's shape (its public config); W5 times a 12-layer slice's MoE blocks, W9 the whole model.
_QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151_936,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    **_QWEN3_COMMON,
)

WORKLOADS: dict[str, Workload] = {
    "W1": Workload(
        "W1",
        "Qwen3-0.6B",
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=True,
            **_QWEN3_COMMON,
        ),
        target=">= 100,000 tokens/s (median of 3 runs) and peak <= 2.2 GiB",
    ),
    "W2": Workload(
        "W2",
        "Llama-3.2-1B",
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128_256,
            tie_word_embeddings=True,
            rope_theta=500_000.0,
            **_LLAMA_COMMON,
        ),
        target=">= 80,000 tokens/s and peak <= 3.5 GiB",
    ),
    "W3": Workload(
        "W3",
        "Qwen3-8B",
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12_288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=False,
            **_QWEN3_COMMON,
        ),
        target=">= 13,500 tokens/s and peak <= 17.5 GiB",
    ),
    "W4": Workload(
        "W4",
        "Qwen3-14B QLoRA",
        "qwen3",
        dict(
            hidden_size=5120,
            intermediate_size=17_408,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=False,
            **_QWEN3_COMMON,
        ),
        quant="nf4",
        target=">= 1.6x the best peer in the same run; peak <= 12 GiB",
    ),
    "W5": Workload(
        "W5",
        "Qwen3-30B-A3B MoE block (12-layer shape)",
        "qwen3_moe",
        dict(_QWEN3_30B_A3B, num_hidden_layers=12),
        kind="moe_block",
        lora_targets=ATTENTION_ONLY,
        target="MoE block forward+backward >= 2x HF's; routing asks the host at most once per layer",
    ),
    "W5b": Workload(
        "W5b",
        "GPT-OSS-20B MoE block (8-layer shape)",
        "gpt_oss",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=8,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201_088,
            num_local_experts=32,
            num_experts_per_tok=4,
            tie_word_embeddings=False,
        ),
        kind="moe_block",
        lora_targets=ATTENTION_ONLY,
        target="MoE block forward+backward >= 2x HF's",
    ),
    # The whole model this time (W5 times one block): 48 layers, 30.5B parameters, about
    # 61 GB (56.8 GiB) of bf16 base resident on the GPU for every implementation, so on an
    # H200 one model fits at a time; the runner frees each before the next is built. Ours
    # (MoE grouping, packed attention, fused CE, offload) against HF + PEFT with transformers'
    # grouped_mm experts (hf_sdpa here builds with experts_implementation="grouped_mm");
    # hf_experts_eager is the eager-experts peer. A call of ours + hf_sdpa fits a 10-minute
    # GPU call with --max-seconds 540 (what does not fit is recorded as skipped).
    # The memory half of the target needs HF's peak >= ~102 GB (ours holds the 61 GB base too):
    # it is a question of how much of HF's logits and activations ours avoids.
    "W9": Workload(
        "W9",
        "Qwen3-30B-A3B MoE, full model (bf16 base ~61 GB)",
        "qwen3_moe",
        dict(_QWEN3_30B_A3B, num_hidden_layers=48),
        lora_targets=ATTENTION_ONLY,
        target=">= 2.5x HF + PEFT (grouped_mm experts) tokens/s at <= 0.6x its peak",
        extra={"peer_experts": "grouped_mm"},
    ),
    "W6": Workload(
        "W6",
        "Llama-3.2-1B, one 32k document",
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128_256,
            tie_word_embeddings=True,
            rope_theta=500_000.0,
            **_LLAMA_COMMON,
        ),
        tokens=32_768,
        packing="single",
        target=">= 1.5x the best peer in the same run (no-keep variant beside it)",
    ),
    "W7": Workload(
        "W7",
        "Llama-3.1-8B QLoRA, longest sequence at 16 GiB",
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14_336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128_256,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            **_LLAMA_COMMON,
        ),
        kind="memcap",
        packing="single",
        quant="nf4",
        tokens=131_072,
        target=">= 196,608 tokens at 16 GiB",
    ),
    # Training methods (issue 30): a DPO step and a GRPO step, timed like the others (bench.runner)
    # on their own data (bench.method_batches). The figure is pairs/s (completions/s) and peak.
    "W10": Workload(
        "W10",
        "Qwen3-8B DPO, 1,024-token pairs",
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12_288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=False,
            **_QWEN3_COMMON,
        ),
        kind="dpo",
        target=">= 2x the best TRL DPO peer's pairs/s at <= 0.6x its peak",
        extra=dict(pairs=16, prompt_mean=256, answer_mean=384, max_tokens=1024, beta=0.1),
    ),
    "W11": Workload(
        "W11",
        "Qwen3-1.7B GRPO, group of 8, 256-token completions",
        "qwen3",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=True,
            **_QWEN3_COMMON,
        ),
        kind="grpo",
        target=">= 2x TRL GRPOTrainer's completions/s (no vLLM on either side)",
        extra=dict(prompts=8, group=8, prompt_mean=64, max_tokens=256, max_new_tokens=256, beta=0.04),
    ),
}

# A model small enough for a CPU: the CI smoke run and the CPU parity check.
CPU_TINY = Workload(
    "CPU-tiny",
    "2-layer Qwen3, hidden 64, vocab 256",
    "qwen3",
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    tokens=512,
    # Its 64-wide LoRA moves the loss about 10x slower per step than the real shapes do: at the
    # recipe's 1e-3 it falls ~0.1 nats in 30 steps, at 1e-2 ~0.5 (the learning check needs 0.3).
    extra={"lr": 1e-2},
)


def tiny_moe(w: Workload, layers: int = 2, experts: int = 8, top_k: int = 2, tokens: int = 512) -> Workload:
    """A MoE workload (W9) at a CPU-sized shape: same architecture and recipe, hidden 64,
    vocab 256, a few experts. For CPU tests of the harness; speed means nothing here."""
    cfg = dict(
        w.config,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )
    # CPU-tiny's learning rate: a 64-wide LoRA moves the loss ~10x slower per step.
    return w.with_changes(id=f"{w.id}-tiny", config=cfg, tokens=tokens, extra=dict(w.extra, lr=1e-2))


def tiny_method(w: Workload, **extra) -> Workload:
    """A training-method workload (W10, W11) at CPU-tiny's shape, with smaller steps (`extra`
    overrides): for CPU tests of the harness; speed means nothing here. GRPO (W11) keeps its
    vocabulary: its completions are read as text through Qwen3's tokenizer (bench.grpo_bench)."""
    cfg = dict(CPU_TINY.config)
    if w.kind == "grpo":
        cfg["vocab_size"] = w.config["vocab_size"]
    return w.with_changes(id=f"{w.id}-tiny", config=cfg, extra=dict(w.extra, lr=1e-2, **extra))


def get_workload(wid: str) -> Workload:
    if wid == CPU_TINY.id:
        return CPU_TINY
    try:
        return WORKLOADS[wid]
    except KeyError:
        raise SystemExit(f"unknown workload {wid!r}; known: {', '.join(WORKLOADS)}") from None


def shrink(w: Workload, layers: int, vocab: int | None = None, tokens: int | None = None) -> Workload:
    """The same shape with fewer layers (and optionally a smaller vocabulary): for parity."""
    cfg = dict(w.config, num_hidden_layers=layers)
    if vocab:
        cfg["vocab_size"] = vocab
    return w.with_changes(id=f"{w.id}-{layers}L", config=cfg, tokens=tokens or w.tokens)


def make_config(w: Workload):
    """The transformers config object of a workload (no download: built from numbers)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(w.arch, **w.config)
    cfg.use_cache = False
    return cfg


def matmul_params(w: Workload) -> int:
    """N of the 6N ceiling: weights that take part in matmuls per token (active experts only)."""
    c = w.config
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q = c["num_attention_heads"] * hd
    kv = c["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h
    if w.arch in ("qwen3_moe", "gpt_oss"):
        e = c.get("num_experts") or c.get("num_local_experts")
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        mlp = c["num_experts_per_tok"] * 3 * h * inter + h * e
    else:
        mlp = 3 * h * c["intermediate_size"]
    return layers * (attn + mlp) + c["vocab_size"] * h


def ceiling_tokens_per_s(w: Workload) -> float:
    return PEAK_FLOPS / (6.0 * matmul_params(w))


def count_matmul_params(model) -> int:
    """N counted from a built model: every Linear weight (base layers, LoRA aside), LM head once."""
    import torch

    seen: set[int] = set()
    total = 0
    for name, mod in model.named_modules():
        if "lora_" in name:
            continue
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            if id(w) not in seen:
                seen.add(id(w))
                total += w.numel() if not hasattr(w, "quant_state") else mod.in_features * mod.out_features
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) not in seen:  # the LM head is a matmul even when tied
        total += head.weight.numel()
    return total


def build_model(w: Workload, *, dtype, device, attn_implementation: str = "sdpa", seed: int = 0):
    """A causal LM with random weights built straight on `device` (no CPU copy of big models)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = make_config(w)
    if w.extra.get("experts_implementation"):
        # transformers 5.x's switch for MoE experts ("eager", "grouped_mm", "batched_mm"); the
        # model's __init__ checks it and raises when this build cannot dispatch it.
        cfg._experts_implementation = w.extra["experts_implementation"]
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
        except TypeError:  # older transformers call it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation=attn_implementation)
    if next(model.parameters()).dtype != dtype:  # a transformers that ignored the dtype argument
        model.to(dtype)
    model.config.use_cache = False
    if w.quant == "nf4":
        quantize_nf4(model, compute_dtype=dtype)
    return model


def quantize_nf4(model, compute_dtype) -> None:
    """Swap every decoder Linear for a bitsandbytes NF4 (double-quant) Linear4bit, in place.

    Equivalent to loading with BitsAndBytesConfig(nf4, double quant), without writing the
    16-bit checkpoint to disk first; the LM head and embeddings stay 16-bit as there.
    """
    import bitsandbytes as bnb
    import torch

    decoder = model.get_decoder()
    for parent in list(decoder.modules()):
        for cname, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            dev = child.weight.device
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True, module=q
            )
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            q.weight = q.weight.to(dev)  # quantizes here (Params4bit.to)
            setattr(parent, cname, q)
            del child
    # PEFT picks its Linear4bit LoRA layer only for models flagged as loaded in 4 bit.
    model.is_loaded_in_4bit = True
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_moe_block(w: Workload, *, dtype, device, experts_implementation: str | None, seed: int = 0):
    """One sparse MoE block of the workload (router + experts), random weights, experts frozen."""
    import torch

    cfg = make_config(w)
    if experts_implementation is not None:
        cfg._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        if w.arch == "qwen3_moe":
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        elif w.arch == "gpt_oss":
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
        else:
            raise ValueError(f"{w.id} has no MoE block")
        block = Block(cfg)
        for p in block.parameters():
            # Module __init__ leaves some weights empty or zero (a zero router ties every expert).
            torch.nn.init.normal_(p, std=0.02)
            p.requires_grad_(False)
    return block.to(dtype)
