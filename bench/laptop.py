"""Laptop cards emulated on a big GPU (issue 15, WORKLOADS.md W8): `tunesmith train` as a user runs it.

For each case (a memory cap in GiB and a model shape) this builds a local model folder with random
bf16 weights of the real shape and the demo tokenizer, writes a learnable JSONL, and runs
``python -m engine train`` in its own process with a studio preset and every setting "auto", under
``TUNESMITH_EMULATE_GPU="<card name>:<GiB>"`` (the engine caps the process with
``torch.cuda.set_per_process_memory_fraction`` and reports the card's name and the cap, see
engine/hardware/profile.py). Each run's record: what the policy chose (from the run's
config.yaml and its reasons), the peak memory, its share of the cap, tokens/s and the loss, or
how it failed.

    python -m bench.laptop --cases 8:qwen3-1.7b,8:qwen3-4b-qlora --steps 20 --out $OUT/laptop.jsonl
    python -m bench.laptop --table bench/results/laptop.jsonl      # the markdown table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.workloads import WORKLOADS
from engine.runs import RunFolder

# Real shapes (public configs); the weights are random: memory and speed do not depend on them.
_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151_936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
_LLAMA = dict(model_type="llama", head_dim=128, vocab_size=128_256, rope_theta=500_000.0, rms_norm_eps=1e-5)
MODELS = {
    "qwen3-1.7b": dict(
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        _LLAMA,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        _QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # The benchmark's W3 and W4 shapes (bench/workloads.py), one source of truth.
    "qwen3-8b": dict(model_type="qwen3", **WORKLOADS["W3"].config),
    "qwen3-14b": dict(model_type="qwen3", **WORKLOADS["W4"].config),
}
# The card a cap stands for (the name the policy reads to know it is a laptop).
CARDS = {
    6: "NVIDIA GeForce RTX 4050 Laptop GPU",
    8: "NVIDIA GeForce RTX 4060 Laptop GPU",
    12: "NVIDIA GeForce RTX 4080 Laptop GPU",
    16: "NVIDIA GeForce RTX 4090 Laptop GPU",
}
ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "resources" / "demo_model"
STUDIO_PRESETS = ROOT / "studio" / "presets"


# Overrides a case may carry after its model ("+seq=2048+rows=1+accum=8"): the config keys they set.
OVERRIDES = {
    "seq": ("data", "max_seq_len"),
    "rows": ("training", "rows_per_micro_batch"),
    "accum": ("training", "grad_accum"),
    "host": ("fast_paths", "host_embeddings"),  # 1: the table in host memory from the start; 0: never
    "lean": ("fast_paths", "lean_recompute"),  # 1: the lean recompute under offload; 0: the full one
    "method": ("training", "method"),  # dpo, orpo, simpo: trains on pairs (write_pairs_jsonl); sft: on text
}
# The methods a case may name, each with the data file it reads: SFT the text documents, the
# paired methods a pairs file written from the same chain (write_pairs_jsonl).
CASE_METHODS = {"sft": "data.jsonl", "dpo": "pairs.jsonl", "orpo": "pairs.jsonl", "simpo": "pairs.jsonl"}


def parse_case(text: str) -> tuple[float, str, bool, dict]:
    """ "8:qwen3-4b-qlora" -> (8, "qwen3-4b", True, {}); "7.5:qwen3-8b-qlora+seq=8192+rows=1"
    -> (7.5, "qwen3-8b", True, {"seq": 8192, "rows": 1}); "+method=dpo" keeps its name. A cap
    between the cards' sizes is the next larger card with part of its memory taken (a desktop on
    the same GPU)."""
    cap_text, _, rest = text.partition(":")
    model, *extra = rest.split("+")
    qlora = model.endswith("-qlora")
    model = model.removesuffix("-qlora")
    try:
        cap = float(cap_text)
        overrides = {k: v if k == "method" else int(v) for k, _, v in (e.partition("=") for e in extra)}
    except ValueError:
        raise SystemExit(
            f"bad case {text!r}: CAP:MODEL[-qlora][+seq=N][+rows=N][+accum=N][+host=0|1][+lean=0|1][+method=NAME]"
        ) from None
    if (
        model not in MODELS
        or not any(cap <= c for c in CARDS)
        or set(overrides) - set(OVERRIDES)
        or overrides.get("method", "sft") not in CASE_METHODS
    ):
        raise SystemExit(
            f"unknown case {text!r}: caps up to {max(CARDS)} GiB, models {sorted(MODELS)} (+ '-qlora'), "
            f"overrides {sorted(OVERRIDES)}, methods {sorted(CASE_METHODS)}"
        )
    return (int(cap) if cap.is_integer() else cap), model, qlora, overrides


def card_for(cap: float) -> str:
    return CARDS[min(c for c in CARDS if cap <= c)]


def model_folder(root: Path, name: str) -> Path:
    """A local Hugging Face folder of `name`'s shape: random bf16 weights and the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / name
    if (folder / "config.json").exists():
        return folder
    spec = dict(MODELS[name])
    spec.setdefault("max_position_embeddings", 40_960)
    cfg = AutoConfig.for_model(spec.pop("model_type"), bos_token_id=None, eos_token_id=2, pad_token_id=0, **spec)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_MODEL / f).exists():
            shutil.copy(DEMO_MODEL / f, tmp / f)
    del model
    torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


def write_pairs_jsonl(path: Path, n_pairs: int, seed: int = 0, words: tuple[int, int] = (250, 550)) -> Path:
    """A JSONL file of {"prompt", "chosen", "rejected"} rows a paired method (DPO) reads, learnable
    like the SFT data: one document of the chain (engine.data.synthetic) split about 2:3 into the
    prompt and the chosen answer, which continues it; the rejected answer is the chosen one's words
    shuffled (same length and words, the chain broken), so the chosen answer is the one a model
    of the chain prefers. With the demo tokenizer's few pieces per word, `words` makes a prompt
    and one answer ~1,024 tokens (W10's pairs), both sides of a pair ~2,048 (`+seq=2048`)."""
    import numpy as np

    from engine.data.synthetic import text_documents

    rng = np.random.default_rng(seed + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in text_documents(n_pairs, seed, words_per_doc=words):
            w = doc.split()
            cut = len(w) * 2 // 5
            answer = w[cut:]
            shuffled = [answer[i] for i in rng.permutation(len(answer))]
            row = {"prompt": " ".join(w[:cut]), "chosen": " ".join(answer), "rejected": " ".join(shuffled)}
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def case_data(work: Path, overrides: dict) -> Path:
    """The data file of a case's method (CASE_METHODS), written once in `work`."""
    path = work / CASE_METHODS[overrides.get("method", "sft")]
    if not path.exists():
        from engine.data.synthetic import write_text_jsonl

        if path.name == "pairs.jsonl":
            write_pairs_jsonl(path, 1500)
        else:
            write_text_jsonl(path, 3000, seed=0, words_per_doc=(200, 700))
    return path


def run_config(
    folder: Path, data: Path, qlora: bool, steps: int, out: Path, overrides: dict | None = None, accum: int = 0
) -> Path:
    """The studio's preset for the case, with the model and data a user would pick; `overrides`
    are the case's own settings, `accum` (if set) the accumulation of every case."""
    import yaml

    preset = "laptop-qlora" if qlora else "quality"
    cfg = yaml.safe_load((STUDIO_PRESETS / f"{preset}.yaml").read_text())
    cfg["model"]["name_or_path"] = str(folder)
    if not qlora:
        cfg["model"]["load_in_4bit"] = "auto"
    cfg["data"].update(source=str(data), format="auto")
    cfg["training"].update(max_steps=steps, save_every=0)
    if accum:
        cfg["training"]["grad_accum"] = accum
    for key, value in (overrides or {}).items():
        section, field = OVERRIDES[key]
        cfg.setdefault(section, {})[field] = bool(value) if key in ("host", "lean") else value
    cfg["output"] = {"dir": str(out.parent), "run_name": out.name}
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def summarize_run(run: Path, cap_gib: int) -> dict:
    events = [json.loads(x) for x in RunFolder(run).metrics.read_text().splitlines() if x.strip()]
    steps = [e for e in events if e.get("event") == "StepMetrics"]
    rec: dict = {"steps": len(steps)}
    if steps:
        peak = max(e.get("mem_peak", 0) for e in steps)
        timed = steps[2:] or steps  # the first steps compile kernels and warm the allocator
        rec.update(
            peak_gib=round(peak / 2**30, 2),
            cap_used=round(peak / (cap_gib * 2**30), 3),
            # What the process holds on the card (the allocator's cache with it): the cap applies
            # to this, and this is what other programs on the card cannot have.
            reserved_gib=round(max(e.get("mem_reserved", 0) for e in steps) / 2**30, 2),
            tokens_per_s=round(statistics.median(e["tokens_per_second"] for e in timed)),
            step_s=round(statistics.median(e["step_seconds"] for e in timed), 3),
            loss_first=steps[0]["loss"],
            loss_last=steps[-1]["loss"],
            offload=steps[-1].get("offload", ""),
        )
        if steps[-1].get("metrics"):  # a method's own measures (DPO: margins, accuracy), first and last step
            rec["method_metrics"] = {"first": steps[0].get("metrics"), "last": steps[-1]["metrics"]}
    cfg_file = RunFolder(run).config
    if cfg_file.exists():
        import yaml

        cfg = yaml.safe_load(cfg_file.read_text())
        t, m = cfg.get("training", {}), cfg.get("model", {})
        rec["chosen"] = {
            "load_in_4bit": m.get("load_in_4bit"),
            "rows_per_micro_batch": t.get("rows_per_micro_batch"),
            "grad_accum": t.get("grad_accum"),
            "max_seq_len": cfg.get("data", {}).get("max_seq_len"),
            "gradient_checkpointing": t.get("gradient_checkpointing"),
            "offload": t.get("offload"),
        }
        rec["reasons"] = cfg.get("auto_reasons") or {}
    pre = [e for e in events if e.get("event") == "PreflightResult"]
    if pre:
        rec["preflight"] = {
            k: pre[-1].get(k) for k in ("peak_bytes", "step_seconds", "rows_per_micro_batch", "micro_batches_per_step")
        }
    rec["memory_changes"] = [e.get("message") for e in events if e.get("event") == "MemoryAdjusted"]
    last = events[-1] if events else {}
    rec["outcome"] = last.get("event")
    if last.get("event") == "Failed":
        rec["error"] = str(last.get("message") or last)[:400]
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.laptop", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="8:qwen3-1.7b,8:qwen3-4b-qlora,8:qwen3-8b-qlora")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="laptop.jsonl", help="JSON-lines file the records are appended to")
    p.add_argument("--work", default="/tmp/tunesmith-laptop", help="model folders, data and runs")
    p.add_argument("--max-seconds", type=float, default=540.0, help="skip cases that would start after this")
    p.add_argument("--case-seconds", type=float, default=150.0, help="stop a case after this (its steps so far count)")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=0,
        help="accumulation for every case instead of the preset's (memory and tokens/s per micro-batch do not depend "
        "on it; 1 makes 20 steps 20 micro-batches, so a case fits a call)",
    )
    p.add_argument("--parallel", type=int, default=1, help="cases run at once on the GPU (tokens/s is then shared)")
    p.add_argument("--table", default=None, help="print the markdown table of a records file and exit")
    p.add_argument("--prepare-only", action="store_true", help="write the cases' model folders and data, then exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table) if Path(args.table).exists() else f"no records in {args.table}")
        return 0

    t0 = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cases = [parse_case(c) for c in args.cases.split(",")]
    data = {CASE_METHODS[o.get("method", "sft")]: case_data(work, o) for *_, o in cases}
    # Model folders are written in the background, in case order, while earlier cases train:
    # writing an 8B or 14B folder takes longer than a case, and a call's time is short.
    builder = ThreadPoolExecutor(max_workers=1)
    folders: dict = {}
    for _, name, _, _ in cases:
        if name not in folders:
            folders[name] = builder.submit(_timed_folder, work / "models", name)
    if args.prepare_only:
        for name, future in folders.items():
            print(f"[laptop] {name}: {future.result()[0]}", flush=True)
        return 0
    lock = threading.Lock()

    def run_case(case: str, cap: float, name: str, qlora: bool, overrides: dict) -> bool:
        label = f"{cap} GiB {name}{' QLoRA' if qlora else ''}"
        if time.monotonic() - t0 > args.max_seconds:
            print(f"[laptop] {label}: skipped (time budget)", flush=True)
            return True
        folder, build_s = folders[name].result()
        run = work / "runs" / case.replace(":", "g-").replace("+", "-").replace("=", "")
        shutil.rmtree(run, ignore_errors=True)
        source = data[CASE_METHODS[overrides.get("method", "sft")]]
        cfg = run_config(folder, source, qlora, args.steps, run, overrides, args.grad_accum)
        env = dict(os.environ, TUNESMITH_EMULATE_GPU=f"{card_for(cap)}:{cap}")
        start = time.monotonic()
        # A case that runs past its time is stopped, and what it measured so far is still
        # recorded (metrics.jsonl is written step by step): a call's time limit loses nothing.
        left = args.max_seconds - (time.monotonic() - t0)
        limit = max(30.0, min(args.case_seconds, left + args.case_seconds / 2))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "engine", "train", str(cfg), "--output", str(run), "--events-json"],
                capture_output=True,
                text=True,
                env=env,
                timeout=limit,
            )
            rc, err = proc.returncode, proc.stderr
            # The typed events the window shows, kept beside the run (a window can replay them).
            (run / "events.jsonl").write_text(proc.stdout, encoding="utf-8")
        except subprocess.TimeoutExpired as exc:
            rc, err = "timeout", (exc.stderr or b"").decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else ""
        rec = {"case": case, "cap_gib": cap, "card": card_for(cap), "model": name, "qlora": qlora, "rc": rc}
        rec.update(overrides=overrides, grad_accum_override=args.grad_accum or None, parallel=args.parallel)
        rec["commit"] = os.environ.get("TUNESMITH_COMMIT") or _commit()
        rec["steps_asked"] = args.steps
        rec["wall_s"] = round(time.monotonic() - start, 1)
        rec["folder_build_s"] = build_s
        if RunFolder(run).metrics.exists():
            rec.update(summarize_run(run, cap))
        if rc != 0:
            rec["stderr_tail"] = (err or "")[-1500:]
        with lock:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[laptop] {label}: {json.dumps({k: v for k, v in rec.items() if k != 'stderr_tail'})}", flush=True)
            if rc != 0:
                print((err or "")[-1500:], flush=True)
        return rc == 0

    # Several cases may share the GPU (each under its own cap): memory, fit and the chosen
    # settings are each process's own, but tokens/s is then shared and says so (`parallel`).
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        ok = list(pool.map(lambda c: run_case(c[0], *c[1]), zip(args.cases.split(","), cases)))
    failed = ok.count(False)
    builder.shutdown(wait=False, cancel_futures=True)
    return 1 if failed else 0


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return out.stdout.strip() or "-"
    except OSError:
        return "-"


def _timed_folder(root: Path, name: str) -> tuple[Path, float]:
    t = time.monotonic()
    folder = model_folder(root, name)
    print(f"[laptop] model folder {name}: {time.monotonic() - t:.0f} s", flush=True)
    return folder, round(time.monotonic() - t, 1)


def records(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def latest_per_case(rows: list[dict]) -> list[dict]:
    """Each case's newest record, in the order the cases were last run."""
    latest = {r["case"]: r for r in rows}
    return sorted(latest.values(), key=lambda r: rows.index(r))


def table(rows: list[dict] | str) -> str:
    if isinstance(rows, str):
        rows = records(rows)
    out = [
        "| cap (card) | model | chosen | steps | peak allocated | of cap | reserved | tokens/s | loss first -> last "
        "| outcome | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        card = f"{r['cap_gib']} GiB ({r['card'].replace('NVIDIA GeForce ', '')})"
        model = f"{r['model']}{' QLoRA' if r.get('qlora') else ''}"
        if r.get("overrides"):
            model += " (" + ", ".join(f"{k} {v}" for k, v in r["overrides"].items()) + ")"
        outcome = r.get("outcome") or "-"
        if r.get("rc") == "timeout" and r.get("steps", 0) >= r.get("steps_asked", 0) > 0:
            outcome = f"all {r['steps']} steps; the case's time limit came during the final eval and save"
        elif r.get("rc") == "timeout":
            outcome = f"{r.get('steps', 0)} of {r.get('steps_asked', '?')} steps in the case's time limit"
        elif r.get("rc") not in (0, None):
            outcome = f"{outcome}: {(r.get('error') or '')[:140]}"
        if r.get("note"):  # added after the run, by hand: what the record turned out to show
            outcome += f" ({r['note']})"
        if not r.get("steps"):
            out.append(f"| {card} | {model} | - | 0 | - | - | - | - | - | {outcome} | {r.get('commit', '-')} |")
            continue
        c = r.get("chosen") or {}
        chosen = (
            f"{'4-bit' if c.get('load_in_4bit') else '16-bit'}, {c.get('rows_per_micro_batch')} row(s) of "
            f"{c.get('max_seq_len')} x {c.get('grad_accum')} accum, checkpointing "
            f"{'on' if c.get('gradient_checkpointing') else 'off'}, offload {r.get('offload') or c.get('offload')}"
        )
        pre = r.get("preflight") or {}
        if pre.get("rows_per_micro_batch") and pre["rows_per_micro_batch"] != c.get("rows_per_micro_batch"):
            chosen += f"; pre-flight: {pre['rows_per_micro_batch']} rows per forward"
        for change in r.get("memory_changes") or []:  # what the run lowered, up to its reason
            if not change.startswith("micro-batch"):
                chosen += "; then " + change.split(":")[0]
        if (r.get("parallel") or 1) > 1:
            chosen += f" [{r['parallel']} cases shared the GPU]"
        out.append(
            f"| {card} | {model} | {chosen} | {r.get('steps')} | {r.get('peak_gib', '-')} GiB | "
            f"{100 * r['cap_used']:.0f}% | {r.get('reserved_gib', '-')} GiB | {r.get('tokens_per_s', 0):,} | "
            f"{r.get('loss_first', float('nan')):.3f} -> {r.get('loss_last', float('nan')):.3f} | {outcome} | "
            f"{r.get('commit', '-')} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
