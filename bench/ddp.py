"""One GPU against N, in one call (issue 18): `tunesmith train` and `tunesmith train --gpus N` on the
same config, model folder and data, as a user runs them.

The model is a local folder of a real shape with random bf16 weights (bench.laptop.model_folder),
the data a learnable JSONL (engine.data.synthetic). The global batch is the same in both runs
(``rows_per_micro_batch x grad_accum`` rows a step), so the loss curves must match: the record
holds both curves, the largest per-step relative difference, the median tokens/s of each and
their ratio (within this call), and the peak memory per GPU.

    python -m bench.ddp --model qwen3-8b --gpus 2 --steps 12 --out $OUT/ddp.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.laptop import MODELS, model_folder
from engine.runs import RunFolder


def _config(folder: Path, data: Path, args, out: Path) -> Path:
    cfg = {
        "model": {"name_or_path": str(folder), "load_in_4bit": False, "dtype": "bfloat16"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        # No held-out split: the bench times training steps, and an eval would be most of a short run.
        "data": {"source": str(data), "format": "auto", "max_seq_len": args.seq_len, "eval_fraction": 0.0},
        "training": {
            "max_steps": args.steps,
            "rows_per_micro_batch": args.rows,
            "grad_accum": args.gpus,  # one micro-batch per GPU and step
            "lr": 2e-4,
            "warmup_steps": 2,
            "gradient_checkpointing": True,
            "offload": "off",
            "save_every": 0,
            "log_every": 1,
            "preflight": "off",
            "seed": 0,
        },
        "output": {"dir": str(out.parent), "run_name": out.name},
    }
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _steps(run: Path) -> list[dict]:
    events = [json.loads(x) for x in RunFolder(run).metrics.read_text().splitlines() if x.strip()]
    return [e for e in events if e.get("event") == "StepMetrics"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rows", type=int, default=8, help="rows per micro-batch (one micro-batch per GPU)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", default="ddp.jsonl")
    p.add_argument("--work", default="/tmp/tunesmith-laptop")
    p.add_argument("--folder", default=None, help="an existing model folder instead of --model's random one")
    p.add_argument("--run-seconds", type=float, default=None, help="stop each run after this (its steps so far count)")
    args = p.parse_args(argv)

    from engine.data.synthetic import write_text_jsonl

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "ddp-data.jsonl"
    if not data.exists():
        write_text_jsonl(data, 4000, seed=3, words_per_doc=(300, 900))
    folder = Path(args.folder) if args.folder else model_folder(work / "models", args.model)
    rec: dict = {
        "model": folder.name if args.folder else args.model,
        "gpus": args.gpus,
        "steps": args.steps,
        "rows": args.rows,
        "seq_len": args.seq_len,
    }
    runs = {}
    for n in (1, args.gpus):
        run = work / "runs" / f"ddp-{args.model}-{n}gpu"
        subprocess.run(["rm", "-rf", str(run)], check=False)
        cfg = _config(folder, data, args, run)
        cmd = [sys.executable, "-m", "engine", "train", str(cfg), "--output", str(run)]
        if n > 1:
            cmd += ["--gpus", str(n)]
        start = time.monotonic()
        # A run past its time is stopped; the steps it logged (metrics.jsonl is written step by
        # step) still count, so a call's time limit does not lose the measurement.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ), start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=args.run_seconds)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            # torchrun's workers share its new process group: none may outlive a stopped run.
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            rc = "timeout"
        rec[f"wall_s_{n}"] = round(time.monotonic() - start, 1)
        rec[f"rc_{n}"] = rc
        steps = _steps(run) if RunFolder(run).metrics.exists() else []
        if rc != 0:
            rec[f"stderr_{n}"] = (err or "")[-2000:]
            print((err or "")[-2000:], flush=True)
        if len(steps) < 3:  # the first steps compile kernels: too few to time
            continue
        timed = steps[2:] or steps
        runs[n] = steps
        rec[f"loss_{n}"] = [round(e["loss"], 5) for e in steps]
        rec[f"tokens_per_s_{n}"] = round(statistics.median(e["tokens_per_second"] for e in timed))
        rec[f"peak_gib_{n}"] = round(max(e["mem_peak"] for e in steps) / 2**30, 2)
        print(f"[ddp] {n} GPU(s): {rec[f'tokens_per_s_{n}']:,} tok/s, peak {rec[f'peak_gib_{n}']} GiB", flush=True)
    if 1 in runs and args.gpus in runs:
        both = min(len(runs[1]), len(runs[args.gpus]))  # the same steps on both: compare only those
        for n in (1, args.gpus):
            rec[f"loss_{n}"] = rec[f"loss_{n}"][:both]
        a, b = rec["loss_1"], rec[f"loss_{args.gpus}"]
        rec["max_step_rel_diff"] = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b))
        rec["loss_fall_1"] = round(a[0] - sum(a[-3:]) / 3, 4)
        rec["speedup"] = round(rec[f"tokens_per_s_{args.gpus}"] / rec["tokens_per_s_1"], 3)
        print(f"[ddp] speedup {rec['speedup']}x, worst step diff {rec['max_step_rel_diff']:.2%}", flush=True)
    rec["bench"] = "ddp"
    rec["commit"] = os.environ.get("TUNESMITH_COMMIT", "")
    rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return 0 if len(runs) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
