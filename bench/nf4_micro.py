"""Micro-benchmark of the fused NF4 matmul against dequantize + cuBLAS, per projection shape.

For every projection of Qwen3-14B (W4), Qwen3-4B and Qwen3-8B (W8) with random bf16 weights
quantized to NF4 (double quant, blocksize 64, as bitsandbytes loads them), and token counts
M (16,384: a W4 step; 2,048 and 8,192: W8's micro-batches), times with CUDA events:

- ``bnb``: bitsandbytes' dequantize_4bit, then torch.mm (the path the fused LoRA Functions took
  before; a dense bf16 copy of W is written and read back);
- ``ours_dq``: engine.kernels.nf4_dequant (bit-exact with bnb), then torch.mm;
- ``fused``: engine.kernels.nf4_matmul, W decoded tile by tile inside the kernel, for each
  candidate tile config (the fastest is reported, and every config's time kept), and as the
  engine runs it (``autotuned``: Triton's autotuner picks among the kernel's candidates);

for the forward product x @ W.T and the input gradient dy @ W, with each one's peak memory
above its inputs. Also the dequantization alone (bnb against ours). One JSON line per shape and
M goes to --out. Run on a GPU: ``python -m bench.nf4_micro --out results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

MODELS = {  # hidden, intermediate, heads, kv heads, head dim
    "qwen3-14b": (5120, 17408, 40, 8, 128),
    "qwen3-4b": (2560, 9728, 32, 8, 128),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
}
TOKENS = {"qwen3-14b": (16384,), "qwen3-4b": (2048, 16384), "qwen3-8b": (8192,)}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the kernel's own candidates and a few more.
EXTRA = {"t": [(128, 128, 64, 4, 4), (128, 64, 64, 4, 4)], "n": [(128, 128, 32, 8, 4), (128, 256, 64, 8, 3)]}


def projections(hidden, inter, heads, kv, d):
    """name -> (out, in) of each distinct projection shape."""
    return {
        "q": (heads * d, hidden),
        "kv": (kv * d, hidden),
        "o": (hidden, heads * d),
        "gate_up": (inter, hidden),
        "down": (hidden, inter),
    }


def timed(fn, iters=10):
    """(median ms, peak bytes above the memory in use before) of fn()."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() - base


def main(argv=None) -> int:
    import bitsandbytes.functional as bnbf

    from engine.kernels.nf4_dequant import NF4Weight, dequantize_nf4_triton
    from engine.kernels.nf4_matmul import CANDIDATES, chosen_config, nf4_matmul_triton

    p = argparse.ArgumentParser(prog="python -m bench.nf4_micro", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON-lines file the records are appended to")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)

    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    for model in args.models.split(","):
        for name, (rows, cols) in projections(*MODELS[model]).items():
            w16 = (torch.randn(rows, cols, device=dev) * 0.02).to(torch.bfloat16)
            packed, state = bnbf.quantize_4bit(w16, blocksize=64, compress_statistics=True, quant_type="nf4")
            del w16
            w = NF4Weight.from_bnb(packed, state)
            rec_dq = {
                "bnb_dequant_ms": timed(lambda: bnbf.dequantize_4bit(packed, state), args.iters)[0],
                "ours_dequant_ms": timed(lambda: dequantize_nf4_triton(w), args.iters)[0],
                "dequant_bit_exact": bool(torch.equal(dequantize_nf4_triton(w), bnbf.dequantize_4bit(packed, state))),
            }
            for m in TOKENS[model]:
                rec = {"bench": "nf4_micro", "gpu": gpu, "model": model, "proj": name, "W": [rows, cols], "M": m}
                rec.update(rec_dq)
                for direction, transpose in (("t", True), ("n", False)):
                    a = torch.randn(m, cols if transpose else rows, device=dev, dtype=torch.bfloat16)

                    def bnb_path():
                        dense = bnbf.dequantize_4bit(packed, state)
                        return torch.mm(a, dense.t() if transpose else dense)

                    def ours_dq_path():
                        dense = dequantize_nf4_triton(w)
                        return torch.mm(a, dense.t() if transpose else dense)

                    ms, peak = timed(bnb_path, args.iters)
                    rec[f"{direction}_bnb_ms"], rec[f"{direction}_bnb_peak_mib"] = ms, peak / 2**20
                    rec[f"{direction}_ours_dq_ms"] = timed(ours_dq_path, args.iters)[0]
                    ref = bnb_path().float()
                    fused = {}
                    for cfg in CANDIDATES[direction] + EXTRA[direction]:
                        try:
                            ms, peak = timed(lambda: nf4_matmul_triton(a, w, transpose, config=cfg), args.iters)
                            err = (
                                (nf4_matmul_triton(a, w, transpose, config=cfg).float() - ref).norm() / ref.norm()
                            ).item()
                            fused[str(cfg)] = {"ms": ms, "peak_mib": peak / 2**20, "rel_err_vs_bnb": err}
                        except Exception as e:  # a config that does not compile (shared memory) is skipped
                            fused[str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    ok = {k: v for k, v in fused.items() if "ms" in v}
                    best = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
                    ms, peak = timed(lambda: nf4_matmul_triton(a, w, transpose), args.iters)
                    rec[f"{direction}_autotuned_ms"], rec[f"{direction}_autotuned_peak_mib"] = ms, peak / 2**20
                    rec[f"{direction}_autotuned_config"] = chosen_config(transpose)
                    rec[f"{direction}_fused"] = fused
                    rec[f"{direction}_fused_best"] = best
                    if best:
                        rec[f"{direction}_fused_ms"] = ok[best]["ms"]
                        rec[f"{direction}_speedup_vs_bnb"] = rec[f"{direction}_bnb_ms"] / ok[best]["ms"]
                rec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                line = json.dumps(rec)
                with open(args.out, "a") as f:
                    f.write(line + "\n")
                short = {
                    k: (round(v, 3) if isinstance(v, float) else v)
                    for k, v in rec.items()
                    if not k.endswith("_fused") and k not in ("gpu", "bench")
                }
                print(json.dumps(short), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
