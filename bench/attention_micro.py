"""Attention alone, per backend: `python -m bench.attention_micro` (GPU).

Times one layer's packed attention forward and forward + backward at the workloads' shapes
(the same document lengths as the bench's first batch) for each backend that can run here:
ours ("triton") and torch's flash varlen kernel ("torch_flash", torch.nn.attention.varlen),
or any other engine.fastpath.attention backend named in --backends. Ours runs once per backward named
in --backwards ("split": dK/dV then dQ, the reference; "onepass": engine.kernels.varlen_attention_bwd;
set through TUNESMITH_ATTN_BWD for the call) and per launch-choice set named in --tunings ("new", the
default; "old": the block sizes and dK/dV addressing of before 2026-12-02, TUNESMITH_ATTN_TUNING) and
per GQA packing named in --packs (TUNESMITH_ATTN_PACK), so before and after land in one run. The
autotuner's memory is cleared before each of ours, so every variant tunes at its own workload's
shape as a fresh training process would, and its picks are recorded (`configs`). It also reports each backend's
largest difference from ours in the output and in dq/dk/dv, so a fast backend that is wrong
shows up here. It is the evidence behind engine.fastpath.attention's backend choice; one JSON line per
(workload, backend, backward) goes to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.batches import make_step
from bench.workloads import get_workload

HERE = Path(__file__).resolve().parent


def _time(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _tuned_picks() -> dict:
    """{kernel: the autotuner's last pick} for the kernels that ran (none when autotuning is off)."""
    from engine.kernels.varlen_attention import tuned_kernels

    picks = {}
    for name, kernel in tuned_kernels().items():
        best = getattr(kernel, "best_config", None)
        if best is not None:
            picks[name] = str(best)
    return picks


def _set_env(name: str, value: str | None) -> str | None:
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    return before


def run(
    workloads: list[str],
    backends: list[str],
    reps: int,
    results: Path | None,
    backwards: tuple[str, ...] = ("auto",),
    tunings: tuple[str, ...] = ("new",),
    packs: tuple[str, ...] = ("1",),
    shape: tuple[int, int, int] | None = None,
) -> list[dict]:
    from engine.fastpath import attention, packed
    from engine.kernels.varlen_attention import TUNING_ENV, forget_tuning
    from engine.kernels.varlen_attention_bwd import BACKWARD_ENV
    from engine.kernels.varlen_attention_configs import PACK_ENV

    dev = torch.device("cuda")
    rows = []
    for wid in workloads:
        wl = get_workload(wid)
        step = make_step(0, wl.tokens, 1000, wl.packing)
        info = packed.PackedSeqInfo.from_lengths(step.lengths).to(dev)
        cfg = wl.config
        hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // hq
        if shape is not None:  # another model's heads at this workload's document lengths
            hq, hkv, d = shape
        t = info.total_tokens
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        do = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        # Causal attention FLOPs: 4 * d * hq * sum(L^2) / 2 forward, 2.5x that backward.
        fwd_flops = 2.0 * d * hq * sum(n * n for n in info.lengths)
        ref = None
        variants = [
            (b, w, u, n)
            for b in backends
            for w in (backwards if b == "triton" else (None,))
            for u in (tunings if b == "triton" else (None,))
            for n in (packs if b == "triton" else (None,))
        ]
        for backend, backward, tuning, pack in variants:
            row = {
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "workload": wid,
                "backend": backend,
                "attn_backward": backward,
                "tuning": tuning,
                "pack": pack,
                "autotune": os.environ.get("TUNESMITH_ATTN_AUTOTUNE", "1") != "0",
                "tokens": t,
                "docs": len(info.lengths),
                "hq": hq,
                "hkv": hkv,
                "head_dim": d,
            }
            before_bwd = _set_env(BACKWARD_ENV, backward) if backward is not None else os.environ.get(BACKWARD_ENV)
            before_tuning = _set_env(TUNING_ENV, tuning) if tuning is not None else os.environ.get(TUNING_ENV)
            before_pack = _set_env(PACK_ENV, pack) if pack is not None else os.environ.get(PACK_ENV)
            if backend == "triton":
                forget_tuning()
            try:
                if not attention.backend_available(backend, q):
                    row["status"] = "not available here"
                    rows.append(row)
                    continue

                def fwd(grad: bool):
                    qq, kk, vv = (x.detach().requires_grad_(grad) for x in (q, k, v))
                    o = attention.varlen_attention(
                        qq, kk, vv, info.cu_seqlens, info.max_seqlen, backend=backend, info=info
                    )
                    return o, (qq, kk, vv)

                def fwd_bwd():
                    o, ins = fwd(True)
                    o.backward(do)
                    return o, ins

                with torch.no_grad():
                    ms_f = _time(lambda: fwd(False), reps)
                ms_fb = _time(fwd_bwd, reps)
                o, ins = fwd_bwd()
                out = [o.detach()] + [x.grad for x in ins]
                if ref is None:
                    ref = out
                diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref)]
                row.update(
                    status="ok",
                    fwd_ms=round(ms_f, 3),
                    fwd_bwd_ms=round(ms_fb, 3),
                    bwd_ms=round(ms_fb - ms_f, 3),
                    fwd_tflops=round(fwd_flops / ms_f / 1e9, 1),
                    fwd_bwd_tflops=round(3.5 * fwd_flops / ms_fb / 1e9, 1),
                    max_diff_vs_first={"o": diffs[0], "dq": diffs[1], "dk": diffs[2], "dv": diffs[3]},
                )
                if backend == "triton":
                    row["configs"] = _tuned_picks()  # empty when autotuning is off
            except Exception as exc:  # one backend failing must not hide the others
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                _set_env(BACKWARD_ENV, before_bwd)
                _set_env(TUNING_ENV, before_tuning)
                _set_env(PACK_ENV, before_pack)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if results is not None:
        with results.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3,W6")
    p.add_argument("--backends", default="triton,torch_flash")
    p.add_argument("--backwards", default="split,onepass", help="our backward(s): split, onepass, auto")
    p.add_argument("--tunings", default="new", help="our launch choices: new, old (TUNESMITH_ATTN_TUNING)")
    p.add_argument(
        "--packs", default="1", help="GQA packing of fwd/dQ (TUNESMITH_ATTN_PACK): 1 auto, 0 off, n forced; e.g. 0,1"
    )
    p.add_argument(
        "--shape", default=None, help="HQ/HKV/D: these heads, not the workload's (16/4/512: Gemma-4's global)"
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--results", type=Path, default=HERE / "results" / "attention_results.jsonl")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_micro needs a CUDA device")
        return 2
    rows = run(
        args.workloads.split(","),
        args.backends.split(","),
        args.reps,
        args.results,
        tuple(args.backwards.split(",")),
        tuple(args.tunings.split(",")),
        tuple(args.packs.split(",")),
        tuple(int(x) for x in args.shape.split("/")) if args.shape else None,
    )
    print(
        f"\n{'workload':8} {'backend':12} {'backward':9} {'tuning':6} {'pack':4} {'fwd ms':>8} {'bwd ms':>8} "
        f"{'fwd+bwd ms':>11} {'fwd TF/s':>9} {'f+b TF/s':>9}  status"
    )
    for r in rows:
        print(
            f"{r['workload']:8} {r['backend']:12} {str(r['attn_backward'] or '-'):9} {str(r['tuning'] or '-'):6} "
            f"{str(r['pack'] or '-'):4} "
            f"{r.get('fwd_ms', '-'):>8} "
            f"{r.get('bwd_ms', '-'):>8} {r.get('fwd_bwd_ms', '-'):>11} "
            f"{r.get('fwd_tflops', '-'):>9} {r.get('fwd_bwd_tflops', '-'):>9}  {r['status']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
