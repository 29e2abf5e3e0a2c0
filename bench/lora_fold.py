"""What folding LoRA's rank products into the base GEMMs would save: `python -m bench.lora_fold` (GPU).

A LoRA projection runs today as three GEMMs: xa = x A^T (K = in), y = xa (sB)^T (K = r, a pass
over the whole output bound by memory) and y += x W^T (the base GEMM, beta=1, reading y back).
Its input gradient likewise: dx = (dy sB) A, then dx += dy W. Folded, the input carries xa in R
spare columns and the weight carries sB (and A, for the backward) beside W:

    y  = [x | s xa] [W | B]^T              dx = [dy | dy sB] [W; A]

one GEMM each, K larger by R. `*_dx_outfold` reads the forward's folded weight the other way:
[dy W | dy sB] = dy [W | sB] in one GEMM (N larger by R), then (dy sB) A is added onto dx.
This times both ways for every projection group of one decoder
layer at the workloads' shapes (16,384 tokens, r = 16), before any engine code is changed for it:
the group's forward (`*_fwd_now` / `*_fwd_fold`) and input gradient (`*_dx_now` / `*_dx_fold`),
plus the base GEMM alone (`*_fwd_base` / `*_dx_base`) for what the LoRA term costs today. One
JSON line per (workload, product) goes to --results.
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


def _group(tokens: int, k_in: int, outs: list[int], r: int, dev, stacked: bool):
    """(name suffix -> fn) for one group of projections sharing an input of width k_in."""
    bf = torch.bfloat16
    R = r * len(outs)
    total = sum(outs)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf) / shape[-1] ** 0.5

    x = rnd(tokens, k_in)
    ws = [rnd(o, k_in) for o in outs]
    a_all = rnd(R, k_in)
    bs = [rnd(o, r) for o in outs]
    w_st = torch.cat(ws)
    y = torch.empty(tokens, total, device=dev, dtype=bf)
    ys = list(y.split(outs, 1))
    dy = rnd(tokens, total)
    dys = list(dy.split(outs, 1))
    dx = torch.empty(tokens, k_in, device=dev, dtype=bf)

    # Folded operands: x_wide = [x | xa], m = [[W | B-blockdiag]; [A | 0]].
    x_wide = torch.empty(tokens, k_in + R, device=dev, dtype=bf)
    x_wide[:, :k_in] = x
    m = torch.zeros(total + R, k_in + R, device=dev, dtype=bf)
    m[:total, :k_in] = w_st
    m[total:, :k_in] = a_all
    row = 0
    for i, (o, b) in enumerate(zip(outs, bs)):
        m[row : row + o, k_in + i * r : k_in + (i + 1) * r] = b
        row += o
    m_fwd = m[:total]
    m_fwd_parts = list(m_fwd.split(outs, 0))
    m_dx = m[:, :k_in]
    dy_wide = torch.empty(tokens, total + R, device=dev, dtype=bf)
    dy_wide[:, :total] = dy

    def fwd_base():
        if stacked:
            torch.mm(x, w_st.t(), out=y)
        else:
            for yi, w in zip(ys, ws):
                torch.mm(x, w.t(), out=yi)

    def fwd_now():
        xa = torch.mm(x, a_all.t())
        for i, (yi, b) in enumerate(zip(ys, bs)):
            torch.mm(xa[:, i * r : (i + 1) * r], b.t(), out=yi)
        if stacked:
            y.addmm_(x, w_st.t())
        else:
            for yi, w in zip(ys, ws):
                yi.addmm_(x, w.t())

    def fwd_fold():
        # x_wide's first k_in columns are written by x's producer; the tail is xa.
        x_wide[:, k_in:].copy_(torch.mm(x_wide[:, :k_in], a_all.t()))
        if stacked:
            torch.mm(x_wide, m_fwd.t(), out=y)
        else:
            for yi, mi in zip(ys, m_fwd_parts):
                torch.mm(x_wide, mi.t(), out=yi)

    def dx_base():
        torch.mm(dy, w_st, out=dx)

    def dx_now():
        g = torch.cat([torch.mm(d, b) for d, b in zip(dys, bs)], 1)
        torch.mm(g, a_all, out=dx)
        dx.addmm_(dy, w_st)

    out_wide = torch.empty(tokens, k_in + R, device=dev, dtype=bf)

    def dx_outfold():
        # The forward's folded weight [W | B-blockdiag] read the other way: dy [W | B] = [dy W | dy B],
        # every projection's dy B landing in its own block of the spare columns (zeros elsewhere), so
        # the per-projection passes over dy for dy B go; the rank term is then added onto dx.
        if stacked:
            torch.mm(dy, m_fwd, out=out_wide)
        else:
            torch.mm(dys[0], m_fwd_parts[0], out=out_wide)
            for d, mi in zip(dys[1:], m_fwd_parts[1:]):
                out_wide.addmm_(d, mi)
        out_wide[:, :k_in].addmm_(out_wide[:, k_in:], a_all)

    def dx_fold():
        # dy_wide's first `total` columns are written by dy's producer; the tail is dy sB.
        col = 0
        for i, (o, b) in enumerate(zip(outs, bs)):
            dy_wide[:, total + i * r : total + (i + 1) * r].copy_(torch.mm(dy_wide[:, col : col + o], b))
            col += o
        torch.mm(dy_wide, m_dx, out=dx)

    return {
        "fwd_base": fwd_base,
        "fwd_now": fwd_now,
        "fwd_fold": fwd_fold,
        "dx_base": dx_base,
        "dx_now": dx_now,
        "dx_fold": dx_fold,
        "dx_outfold": dx_outfold,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--results", type=Path, default=HERE / "results" / "lora_fold.jsonl")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(0)
    for wid in args.workloads.split(","):
        wl = get_workload(wid.strip())
        c = wl.config
        h, inter = c["hidden_size"], c["intermediate_size"]
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        groups = {
            "qkv": (h, [q_out, kv_out, kv_out], False),
            "o": (q_out, [h], False),
            "gate_up": (h, [inter, inter], h <= 1024),
            "down": (inter, [h], False),
        }
        totals: dict[str, float] = {}
        for gname, (k_in, outs, stacked) in groups.items():
            fns = _group(args.tokens, k_in, outs, args.rank, dev, stacked)
            for fname, fn in fns.items():
                ms = _time(fn, args.reps)
                totals[fname] = totals.get(fname, 0.0) + ms
                rec = dict(
                    date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    gpu=gpu,
                    torch=torch.__version__,
                    workload=wl.id,
                    product=f"{gname}_{fname}",
                    tokens=args.tokens,
                    rank=args.rank,
                    ms=round(ms, 4),
                )
                print(json.dumps(rec), flush=True)
                args.results.parent.mkdir(parents=True, exist_ok=True)
                with args.results.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            del fns
            torch.cuda.empty_cache()
        layers = c["num_hidden_layers"]
        # A checkpointed step runs each layer's forward twice (forward, recompute) and one backward.
        now = 2 * totals["fwd_now"] + totals["dx_now"]
        fold = 2 * totals["fwd_fold"] + totals["dx_fold"]
        base = 2 * totals["fwd_base"] + totals["dx_base"]
        summary = dict(
            workload=wl.id,
            gpu=gpu,
            per_layer_ms=dict(base=round(base, 4), now=round(now, 4), fold=round(fold, 4)),
            per_step_ms=dict(
                lora_now=round((now - base) * layers, 2),
                lora_fold=round((fold - base) * layers, 2),
                saved=round((now - fold) * layers, 2),
                dx_outfold_saved=round((totals["dx_now"] - totals["dx_outfold"]) * layers, 2),
            ),
        )
        print(json.dumps(summary), flush=True)
        with args.results.open("a") as f:
            f.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
