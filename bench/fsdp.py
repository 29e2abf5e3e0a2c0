"""FSDP2 on a base larger than one card (issue 18): a Llama-3.1-70B-shaped bf16 LoRA across N GPUs.

No model folder: 140 GB of weights cannot be written to the host's disk. The model is built from
its config on the meta device, LoRA (r=16, all-linear) is attached there, the engine's fast paths
are switched on, every decoder layer and the root are sharded with the engine's own
`engine.train.fsdp.shard`, and only then does each rank materialize its shards on its GPU
(`to_empty`) and fill them with random values (base ~ N(0, 0.02), norms 1, LoRA A uniform, B 0;
the rotary buffers recomputed). Training runs on learnable synthetic tokens (bench.batches:
the Markov chain of engine.data.synthetic), so the loss must fall: a speed counts only beside it.

Each rank trains one packed row of --seq-len tokens per step, with gradient checkpointing;
FSDP averages the adapter gradients. The record (one JSON line appended to --out, by rank 0)
holds the shape, world size, steps done, the per-step losses, the median tokens/s over the steps
after the first (whole world), each step's seconds, the peak memory of every GPU, the setup time
and the commit. --max-seconds stops between steps before a time limit, and the record says so.

    torchrun --nproc-per-node 2 -m bench.fsdp --steps 8 --out $OUT/fsdp.jsonl

Small on a CPU (gloo), as the tests run it:

    torchrun --nproc-per-node 2 -m bench.fsdp --layers 2 --hidden 64 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 512 --seq-len 128 --steps 3 --out /tmp/fsdp.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

# Llama-3.1-70B (meta-llama/Llama-3.1-70B config.json).
LLAMA_70B = dict(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256, rope_theta=500000.0)


def _init_process_group(torch, dist, device):
    """Join torchrun's group; a plain `python -m bench.fsdp` is a group of one (FSDP needs one)."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=max(8192, args.seq_len),
        rope_theta=LLAMA_70B["rope_theta"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def _materialize(torch, root, device, seed: int) -> None:
    """to_empty on this rank's device, then random local shards and recomputed rotary buffers."""
    from engine.train.fsdp import local

    root.to_empty(device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1000 * int(os.environ.get("RANK", "0")))
    with torch.no_grad():
        for name, p in root.named_parameters():
            t = local(p)
            if "lora_B" in name:
                t.zero_()  # PEFT's init: the adapted model starts as the base
            elif "lora_A" in name:
                bound = 1.0 / math.sqrt(p.shape[1])
                t.uniform_(-bound, bound, generator=gen)
            elif "norm" in name:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
        # Non-persistent buffers are not parameters: to_empty left them uninitialized.
        for module in root.modules():
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "config"):
                inv_freq, module.attention_scaling = _rope_init(module)(module.config)
                module.inv_freq.copy_(inv_freq.to(device))
                if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                    module.original_inv_freq.copy_(inv_freq.to(device))


def _rope_init(module):
    """The rotary embedding's own init function (transformers keeps it local to __init__)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = getattr(module, "rope_type", "default")
    return module.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="fsdp.jsonl")
    p.add_argument("--layers", type=int, default=LLAMA_70B["layers"])
    p.add_argument("--hidden", type=int, default=LLAMA_70B["hidden"])
    p.add_argument("--heads", type=int, default=LLAMA_70B["heads"])
    p.add_argument("--kv-heads", type=int, default=LLAMA_70B["kv_heads"])
    p.add_argument("--intermediate", type=int, default=LLAMA_70B["intermediate"])
    p.add_argument("--vocab", type=int, default=LLAMA_70B["vocab"])
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per rank and step (one packed row)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--lr", type=float, default=3e-3, help="high enough that 8 steps show the fall")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: bf16 on CUDA")
    p.add_argument("--no-fast-paths", action="store_true", help="the stock transformers modules")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop between steps before this (0: no limit)")
    args = p.parse_args(argv)
    started = time.time()

    import torch
    import torch.distributed as dist

    from engine.config import FastPathConfig, LoraConfig
    from engine.models.lora import attach_lora
    from engine.train import fsdp
    from engine.train.optim import make_optimizer
    from engine.train.step import forward_loss, prepare_model

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    _init_process_group(torch, dist, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    auto = torch.bfloat16 if cuda else torch.float32
    dtype = {"auto": auto, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32)

    from transformers import AutoModelForCausalLM

    hf_cfg = _llama_config(args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    base_params = sum(p.numel() for p in model.parameters())
    model = attach_lora(model, LoraConfig(r=args.rank, alpha=2.0 * args.rank, dropout=0.0))
    on = "auto" if cuda else True  # on a CPU: the torch references of the same patched paths
    fast = FastPathConfig(
        **(
            dict(kernels=False, lora_autograd=False, fused_ce=False, packed_attention=True)
            if args.no_fast_paths
            else dict(kernels=on, lora_autograd=on, fused_ce=on, packed_attention=True)
        )
    )
    prepared = prepare_model(model, fast, device, gradient_checkpointing=True, offload="off")

    def loss_fn(inner, batch, normalizer):
        return forward_loss(inner, batch, normalizer, fused_ce=prepared.report.get("fused_ce") == "on")

    root = fsdp.shard(prepared.model, loss_fn, device, world)
    _materialize(torch, root, device, seed=0)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    lora_params = sum(q.numel() for q in params)
    optimizer = make_optimizer(model, args.lr)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    setup_s = time.time() - started

    from bench.batches import make_step
    from bench.report import git_commit, now_iso
    from engine.data.collate import PackedBatch

    losses, step_s, tok_s, stopped_early = [], [], [], False
    for step in range(args.steps):
        t0 = time.perf_counter()
        # Rank r's row of step s: seed (s, r), the same chain for all.
        row = make_step(10_000 * step + rank, args.seq_len, args.vocab)
        batch = PackedBatch.from_documents(row.documents()).to(device)
        loss = root(batch, max(1, batch.num_trained_tokens))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # also the step's end: every rank has finished its backward
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(float(mean) / world)
        step_s.append(round(dt, 4))
        tok_s.append(world * batch.num_tokens / dt)
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, {dt:.2f} s, {tok_s[-1]:.0f} tokens/s", flush=True)
        # Every rank stops at the same step: rank 0's clock decides.
        late = torch.tensor(
            [int(args.max_seconds > 0 and time.time() - started + dt * 1.5 > args.max_seconds)], device=device
        )
        dist.broadcast(late, 0)
        if bool(late) and step + 1 < args.steps:
            stopped_early = True
            break

    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        timed = tok_s[1:] or tok_s  # the first step also compiles and autotunes
        rec = {
            "bench": "fsdp",
            "time": now_iso(),
            "commit": git_commit(),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "world_size": world,
            "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")},
            "base_params": base_params,
            "lora_params": lora_params,
            "dtype": str(dtype).replace("torch.", ""),
            "seq_len_per_rank": args.seq_len,
            "fast_paths": {k: v for k, v in prepared.report.items()},
            "steps": args.steps,
            "steps_done": len(losses),
            "stopped_early": stopped_early,
            "losses": [round(x, 5) for x in losses],
            "learned": len(losses) > 1 and losses[-1] < losses[0],
            "step_seconds": step_s,
            "tokens_per_s_median": round(statistics.median(timed), 1) if timed else None,
            "peak_mem_gib_per_gpu": [round(x / 2**30, 2) for x in peaks] if cuda else None,
            "setup_s": round(setup_s, 1),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's finalization: objects that still hold gloo work (FSDP's
    # gathered parameters among them) can be destroyed there after the process group, and a
    # gloo thread then aborts the process ("terminate called without an active exception",
    # seen once in CI on a CPU run whose record was already written). Nothing is left to write.
    os._exit(code)
