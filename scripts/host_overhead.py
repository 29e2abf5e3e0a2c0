"""CPU proxy for the per-layer host overhead of one training step (no GPU needed).

Builds a random Qwen3 model wrapped by PEFT (LoRA on every linear, fp32 adapters), applies the
engine's fast paths and HF's non-reentrant gradient checkpointing, and reports:

- ops: aten ops recorded by torch.profiler for one forward+backward+optimizer step, per decoder
  layer (the difference between an L-layer and an (L+1)-layer model, so the embedding, head
  and loss do not count), with the most frequent op names;
- time: CPU wall time per step of a mid-size model (fp32 so CPU matmuls are not emulated bf16).

    python scripts/host_overhead.py ops [--dtype bf16]
    python scripts/host_overhead.py time [--hidden 1024 --layers 4 --tokens 2048 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def build(layers, hidden, inter, heads, kv_heads, head_dim, dtype, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config import FastPathConfig
    from engine.train.step import prepare_model

    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=256,
        max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.to(dtype)
    for n, p in model.named_parameters():  # PEFT keeps adapters in fp32 on a low-precision base
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    report = prepare_model(model, FastPathConfig(), "cpu", gradient_checkpointing=True).report
    return model, report


def batch(tokens, vocab=256, doc=256, seed=1):
    from engine.data.collate import PackedBatch

    g = torch.Generator().manual_seed(seed)
    docs, left = [], tokens
    while left:
        n = min(doc, left)
        docs.append(torch.randint(0, vocab, (n,), generator=g).tolist())
        left -= n
    return PackedBatch.from_documents(docs)


def one_step(model, b, opt):
    from engine.train.step import forward_loss

    loss = forward_loss(model, b, float(b.num_trained_tokens))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def count_ops(layers, dtype, tokens=64):
    model, report = build(layers, 64, 96, 4, 2, 16, dtype)
    b = batch(tokens, doc=16)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    one_step(model, b, opt)  # warm-up: lazily built state (rotary caches, registries)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step(model, b, opt)
    names = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        names["all aten"] += 1
        anc = e.cpu_parent
        while anc is not None and not anc.name.startswith("LoRA"):
            anc = anc.cpu_parent
        if anc is not None:
            names["inside the LoRA Functions (fwd, recompute, bwd)"] += 1
        parent = e.cpu_parent
        if parent is None or not parent.name.startswith("aten::"):
            names["top-level aten (dispatches from Python/autograd)"] += 1
        if not e.cpu_children and e.name not in _NO_KERNEL:
            names["leaf compute (~device kernels)"] += 1
            names[e.name] += 1
    return names, report


# Metadata-only ops: no device kernel is launched for these.
_NO_KERNEL = {
    "aten::" + n
    for n in (
        "as_strided view _unsafe_view reshape transpose t slice select expand unsqueeze squeeze "
        "detach alias resolve_conj resolve_neg empty empty_strided empty_like split narrow "
        "permute contiguous lift_fresh _reshape_alias unbind chunk split_with_sizes"
    ).split()
}


def cmd_ops(args):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    a, report = count_ops(2, dtype)
    b, _ = count_ops(3, dtype)
    per_layer = b.copy()
    per_layer.subtract(a)
    print("fast paths:", report)
    print(f"per decoder layer (fwd + recompute + bwd + optimizer), dtype={args.dtype}:")
    for key in (
        "inside the LoRA Functions (fwd, recompute, bwd)",
        "all aten",
        "top-level aten (dispatches from Python/autograd)",
        "leaf compute (~device kernels)",
    ):
        print(f"  {per_layer.pop(key):5d} {key}")
    print("leaf compute ops by name:")
    for name, n in per_layer.most_common(args.top):
        print(f"  {n:5d} {name}")


def cmd_time(args):
    torch.set_num_threads(args.threads)
    model, _ = build(
        args.layers, args.hidden, args.hidden * 3, args.hidden // 64, max(1, args.hidden // 256), 64, torch.float32
    )
    b = batch(args.tokens)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    one_step(model, b, opt)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        one_step(model, b, opt)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(
        f"hidden={args.hidden} layers={args.layers} tokens={args.tokens}: "
        f"median {1e3 * times[len(times) // 2]:.1f} ms/step, min {1e3 * times[0]:.1f} ms"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["ops", "time"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cmd_ops(args) if args.what == "ops" else cmd_time(args)


if __name__ == "__main__":
    main()
