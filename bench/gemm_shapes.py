"""The base GEMMs of one decoder layer, one by one and fused: `python -m bench.gemm_shapes` (GPU).

Times, at the workloads' shapes (16,384 tokens), every frozen-base product a LoRA layer runs:
the forward (x @ W.T) and the input gradient (dy @ W, the backward adding each projection onto
one dx) of q/k/v, o, gate/up and down, and the same with the projections that share an input
(q/k/v; gate/up) stacked into one weight. It says how far each GEMM is from the card's rate and
what stacking would save per layer, before any engine code is changed for it. One JSON line per
(workload, product) goes to --results.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.attention_micro import _time
from bench.workloads import get_workload

HERE = Path(__file__).resolve().parent


def _products(cfg: dict, tokens: int, dev) -> list[tuple[str, float, object]]:
    """(name, flops, fn) for each product of one layer, separate and stacked."""
    h, inter = cfg["hidden"], cfg["intermediate"]
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["heads"] * hd, cfg["kv_heads"] * hd
    bf = torch.bfloat16

    def w(o, i):
        return torch.randn(o, i, device=dev, dtype=bf) / i**0.5

    x = torch.randn(tokens, h, device=dev, dtype=bf)
    wq, wk, wv, wo = w(q_out, h), w(kv_out, h), w(kv_out, h), w(h, q_out)
    wg, wu, wd = w(inter, h), w(inter, h), w(h, inter)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    a = torch.randn(tokens, q_out, device=dev, dtype=bf)
    hh = torch.randn(tokens, inter, device=dev, dtype=bf)
    dqkv = torch.randn(tokens, q_out + 2 * kv_out, device=dev, dtype=bf)
    dq, dk, dv = (t.contiguous() for t in dqkv.split([q_out, kv_out, kv_out], 1))
    dgu = torch.randn(tokens, 2 * inter, device=dev, dtype=bf)
    dg, du = (t.contiguous() for t in dgu.split([inter, inter], 1))
    dy = torch.randn(tokens, h, device=dev, dtype=bf)
    dx = torch.empty(tokens, h, device=dev, dtype=bf)

    def fl(o, i):
        return 2.0 * tokens * o * i

    def acc(parts):
        def run():
            torch.mm(parts[0][0], parts[0][1], out=dx)
            for g, wt in parts[1:]:
                dx.addmm_(g, wt)

        return run

    return [
        ("qkv_fwd_separate", fl(q_out + 2 * kv_out, h), lambda: [x @ t.t() for t in (wq, wk, wv)]),
        ("qkv_fwd_stacked", fl(q_out + 2 * kv_out, h), lambda: x @ wqkv.t()),
        ("qkv_dx_separate", fl(q_out + 2 * kv_out, h), acc([(dq, wq), (dk, wk), (dv, wv)])),
        ("qkv_dx_stacked", fl(q_out + 2 * kv_out, h), lambda: torch.mm(dqkv, wqkv, out=dx)),
        ("qkv_dx_cat_then_stacked", fl(q_out + 2 * kv_out, h), lambda: torch.mm(torch.cat([dq, dk, dv], 1), wqkv)),
        ("o_fwd", fl(h, q_out), lambda: a @ wo.t()),
        ("o_dx", fl(h, q_out), lambda: dy @ wo),
        ("gate_up_fwd_separate", fl(2 * inter, h), lambda: [x @ t.t() for t in (wg, wu)]),
        ("gate_up_fwd_stacked", fl(2 * inter, h), lambda: x @ wgu.t()),
        ("gate_up_dx_separate", fl(2 * inter, h), acc([(dg, wg), (du, wu)])),
        ("gate_up_dx_stacked", fl(2 * inter, h), lambda: torch.mm(dgu, wgu, out=dx)),
        ("down_fwd", fl(h, inter), lambda: hh @ wd.t()),
        ("down_dx", fl(h, inter), lambda: dy @ wd),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--results", type=Path, default=HERE / "results" / "gemm_shapes.jsonl")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(0)
    for wid in args.workloads.split(","):
        wl = get_workload(wid.strip())
        cfg = dict(
            hidden=wl.config["hidden_size"],
            intermediate=wl.config["intermediate_size"],
            heads=wl.config["num_attention_heads"],
            kv_heads=wl.config["num_key_value_heads"],
            head_dim=wl.config.get("head_dim") or wl.config["hidden_size"] // wl.config["num_attention_heads"],
        )
        for name, flops, fn in _products(cfg, args.tokens, dev):
            ms = _time(fn, args.reps)
            rec = dict(
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                gpu=gpu,
                torch=torch.__version__,
                workload=wl.id,
                product=name,
                tokens=args.tokens,
                ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 1),
            )
            print(json.dumps(rec), flush=True)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
