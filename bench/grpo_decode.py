"""W11's generation alone, old against new: `python -m bench.grpo_decode` on a GPU.

Ours' GRPO step on W11 (Qwen3-1.7B, 8 prompts x 8 completions, 256 new tokens) spent most of
its time generating, host-bound. This times one group's generation three ways on the W11 model
(random bf16 weights built on the device, PEFT LoRA r=16 on every linear layer with random B,
the engine's fast paths applied, as a run has them), in one process with the same prompts:

- `old`: transformers' generate with the engine's packed attention on, exactly as GRPO
  sampled inside a run before engine.train.decoding (the KV-cache steps took the packed
  function's dense fallback; and it read left padding, see unpacked_attention);
- `generate`: transformers' generate with sdpa, as GRPO's fallback now runs it (not by default);
- `eager`: the engine's decode loop with its step run op by op;
- `graph`: the same loop with its step captured as a CUDA graph (the default on CUDA).

Each is run once short (warm-up: Triton compiles, cuBLAS) and then timed. Prints one JSON line
per way (seconds, ms per decoding step, completions/s) and whether eager and graph sampled the
same tokens for the same seed. Takes about a minute on an H200 (most of it `old`).

    python -m bench.grpo_decode [--max-new 256] [--prompts 8] [--group 8] [--ways old,generate,eager,graph]
"""

from __future__ import annotations

import argparse
import json
import time


def build(device: str, seed: int = 0):
    """W11's model on a GPU; on a CPU (a smoke run of this script) the 2-layer CPU_TINY Qwen3 in fp32."""
    import torch
    from peft import LoraConfig, get_peft_model

    from bench.workloads import CPU_TINY, WORKLOADS, build_model
    from engine.config import FastPathConfig
    from engine.models.patches import apply_fast_paths

    cpu = torch.device(device).type == "cpu"
    w, dtype = (CPU_TINY, torch.float32) if cpu else (WORKLOADS["W11"], torch.bfloat16)
    model = build_model(w, dtype=dtype, device=device, seed=seed)
    model.config.use_cache = True
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    report = apply_fast_paths(model, FastPathConfig(), device)
    return model.eval(), report, model.get_input_embeddings().weight.shape[0]


def main(argv=None) -> int:
    import torch

    from engine.train import decoding
    from engine.train.objectives.grpo import generate_completions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--ways", default="old,eager,graph", help="comma-separated: old,generate,eager,graph")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run on the tiny CPU model")
    args = ap.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    dev = args.device
    cuda = torch.device(dev).type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model, fast, vocab = build(dev)
    print(json.dumps({"fast_paths": fast, "decode_refusal": decoding.decode_refusal(model, 1 << 20)}))
    g = torch.Generator().manual_seed(1)
    ordinary = min(vocab, 151_643)  # below Qwen3's special tokens
    lengths = [int(args.prompt_len * (0.5 + i / max(1, args.prompts - 1))) for i in range(args.prompts)]
    prompts = [torch.randint(0, ordinary, (n,), generator=g).tolist() for n in lengths]
    eos = {151_645, 151_643}  # Qwen3's end tokens (random weights rarely sample them)
    pad = min(151_643, vocab - 1)

    def way(name):
        def fn(new):
            report = {}
            if name == "old":
                from engine.fastpath.attention import disable_packed_attention, enable_packed_attention
                from engine.train.objectives.grpo import _generate

                enable_packed_attention(model)
                try:
                    rows = _generate(model, prompts, args.group, new, 1.0, 1.0, eos, pad, dev, False, False)
                finally:
                    disable_packed_attention(model)
            elif name == "generate":
                rows = generate_completions(model, prompts, args.group, new, 1.0, 1.0, eos, pad, dev)
            else:
                graphs = None if name == "graph" else False
                rows = decoding.decode(
                    model, prompts, args.group, new, 1.0, 1.0, eos, pad, dev, graphs=graphs, report=report
                )
            return rows, report.get("graph", "-")

        return fn

    tokens = {}
    with torch.no_grad():
        for name in ways:
            fn = way(name)
            torch.manual_seed(0)
            fn(4)  # warm-up
            sync()
            torch.manual_seed(0)
            t = time.perf_counter()
            rows, graph = fn(args.max_new)
            sync()
            dt = time.perf_counter() - t
            steps = max(len(r) for r in rows)
            tokens[name] = rows
            rec = {
                "way": name,
                "seconds": round(dt, 3),
                "steps": steps,
                "ms_per_step": round(1000 * dt / max(1, steps), 2),
                "completions_per_s": round(len(rows) / dt, 2),
                "graph": graph,
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            }
            print(json.dumps(rec), flush=True)
    if "eager" in tokens and "graph" in tokens:
        same = sum(a == b for a, b in zip(tokens["eager"], tokens["graph"]))
        print(json.dumps({"eager_graph_same_rows": same, "rows": len(tokens["graph"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
