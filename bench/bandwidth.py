"""How close the memory-bound passes of a step come to the card's bandwidth: `python -m bench.bandwidth` (GPU).

A W1 step is 0.168 s where 100k tok/s needs 0.164, and what is left outside the big GEMMs is passes
bound by memory: LoRA's B gradients (dB = s dy^T xa, reading every projection's output gradient),
the fused q/k norm + RoPE, the gated activation. For each at a workload's shapes (one decoder layer,
16,384 tokens, r = 16) this times the pass, counts the bytes it must move, and prints the achieved
GB/s beside a plain device copy's (what the card gives a simple stream of reads and writes). dB is
timed both ways: cuBLAS (`rank_grad_reference`, what the engine ran before) and the token-split kernel
(`engine.kernels.rank_grad`, at several program counts and token steps). The q/k norm + RoPE is timed
at every warp count (its other program shares, tokens a program and q and k apart, were timed at
dc92e8b and dropped: bench/results/bandwidth.jsonl). The loss's row pass (engine.kernels.fused_ce) is
timed over one chunk of logits at several warp counts (a few programs per SM walking the rows was timed
at e56908d and dropped). Each pass is timed as a
CUDA graph of 20 calls, as a step graph replays it: a small kernel's host launch cost (a Triton
launch's Python is tens of microseconds) is not counted. One JSON line per (workload, pass) goes to
--results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.workloads import get_workload

HERE = Path(__file__).resolve().parent


def _passes(c: dict, tokens: int, r: int, dev) -> dict:
    """{name: (fn, bytes moved)} for one layer of the config `c`."""
    from engine.kernels import activations as act
    from engine.kernels import qk_norm_rope, rank_grad

    bf = torch.bfloat16
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    el = 2

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf)

    out: dict = {}
    big = rnd(tokens, 4096)
    out["copy"] = (lambda: big.clone(), 2 * big.numel() * el)
    xa = rnd(tokens, 4 * r)
    for name, width in (("q", hq * hd), ("kv", hkv * hd), ("o", h), ("gate_up", 2 * inter), ("down", h)):
        dy = rnd(tokens, width)
        moved = (dy.numel() + tokens * r) * el
        out[f"dB_{name}_cublas"] = (
            lambda dy=dy: rank_grad.rank_grad_reference(dy, xa[:, :r], 2.0, torch.float32),
            moved,
        )
        sms = rank_grad._sm_count(dy.device)
        for programs in (sms, 2 * sms, 4 * sms):  # one, two and four programs per SM
            for step in (64, 128):

                def split(dy=dy, programs=programs, step=step):
                    kept = rank_grad._TARGET_PROGRAMS, rank_grad.BLOCK_T
                    rank_grad._TARGET_PROGRAMS, rank_grad.BLOCK_T = programs, step
                    try:
                        return rank_grad.rank_grad_triton(dy, xa[:, :r], 2.0, torch.float32)
                    finally:
                        rank_grad._TARGET_PROGRAMS, rank_grad.BLOCK_T = kept

                out[f"dB_{name}_split_p{programs}_t{step}"] = (split, moved)
    # The q/k norm + RoPE, forward and backward, at every warp count.
    q, k = rnd(1, tokens, hq, hd), rnd(1, tokens, hkv, hd)
    wq, wk = torch.ones(hd, device=dev, dtype=bf), torch.ones(hd, device=dev, dtype=bf)
    cos, sin = rnd(1, tokens, hd), rnd(1, tokens, hd)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    dq, dk = rnd(1, tokens, hq, hd), rnd(1, tokens, hkv, hd)
    qk = (q.numel() + k.numel()) * el
    for warps in (None, 1, 2, 4, 8):
        tag = "default" if warps is None else f"w{warps}"
        out[f"qk_norm_rope_fwd_{tag}"] = (
            lambda w=warps: qk_norm_rope._launch(q, k, qo, ko, qo, ko, wq, wk, cos, sin, 1e-6, 1e-6, 0.0, False, w),
            2 * qk,
        )
        out[f"qk_norm_rope_bwd_{tag}"] = (
            lambda w=warps: qk_norm_rope._launch(q, k, dq, dk, qo, ko, wq, wk, cos, sin, 1e-6, 1e-6, 0.0, True, w),
            3 * qk,
        )
    gate, up, dh = rnd(tokens, inter), rnd(tokens, inter), rnd(tokens, inter)
    g2, u2 = gate.clone(), up.clone()
    out["gated_fwd"] = (lambda: act.gated_act_forward(gate, up, "silu"), 3 * gate.numel() * el)

    def gated_bwd():
        # In place over its inputs (as the MLP runs it): fresh copies each time are not timed apart.
        act.gated_act_backward_and_output(dh, g2, u2, "silu")

    out["gated_bwd"] = (gated_bwd, 6 * gate.numel() * el)
    # The loss's row pass over one chunk of bf16 logits: read for the logsumexp, read again and
    # written as the gradient (3 row-lengths moved; a second read found in L2 shows as more than the copy).
    from engine.kernels import fused_ce

    vocab = c["vocab_size"]
    rows = fused_ce.default_chunk_tokens(vocab, el)
    logits = rnd(rows, vocab)
    targets = torch.randint(0, vocab, (rows,), device=dev)
    loss_rows = torch.empty(rows, device=dev, dtype=torch.float32)
    for warps in (4, 8, 16):

        def ce(warps=warps):
            kept = fused_ce.CE_NUM_WARPS
            fused_ce.CE_NUM_WARPS = warps
            try:
                fused_ce._ce_rows(logits, targets, loss_rows, -100, 1.0, None, True)
            finally:
                fused_ce.CE_NUM_WARPS = kept

        out[f"ce_rows_w{warps}"] = (ce, 3 * logits.numel() * el)
    return out


def _graph_ms(fn, calls: int = 20, reps: int = 10) -> float:
    """Milliseconds a call of fn() takes on the device, from replays of a CUDA graph of `calls` calls
    (median of `reps` replays). Compiles and warms up outside the graph first."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--only", default="", help="comma-separated name prefixes of the passes to time (and the copy)")
    p.add_argument("--results", type=Path, default=HERE / "results" / "bandwidth.jsonl")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(0)
    for wid in args.workloads.split(","):
        wl = get_workload(wid.strip())
        passes = _passes(wl.config, args.tokens, args.rank, dev)
        copy_gbs = None
        prefixes = tuple(x for x in args.only.split(",") if x) + ("copy",)
        for name, (fn, moved) in passes.items():
            if args.only and not name.startswith(prefixes):
                continue
            ms = _graph_ms(fn)
            gbs = moved / ms / 1e6
            copy_gbs = gbs if name == "copy" else copy_gbs
            rec = dict(
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                commit=os.environ.get("TUNESMITH_COMMIT"),
                gpu=gpu,
                torch=torch.__version__,
                workload=wl.id,
                product=name,
                tokens=args.tokens,
                rank=args.rank,
                ms=round(ms, 4),
                gb_s=round(gbs, 1),
                of_copy=round(gbs / copy_gbs, 3),
            )
            print(json.dumps(rec), flush=True)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        del passes
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
