"""`python -m bench` (and `tunesmith bench`): the reference-workload benchmark.

    python -m bench --workloads W1,W2,W3 --max-seconds 540     # speed, all peers
    python -m bench --workloads W1 --impls ours --ours-variants all-on,no-kernels,no-fused-ce
    python -m bench --workloads W1 --impls ours,hf_sdpa,trl_sdpa,trl_liger,liger_varlen  # the peers users pick
    python -m bench --parity                                   # learning check (30 steps) + one-step grads
    python -m bench --memcap                                   # W7, longest sequence at 16 GiB
    python -m bench --memcap --memcap-impls ours:offload-single,liger_varlen,trl_liger_varlen,unsloth
    python -m bench --workloads W9 --impls ours,hf --max-seconds 540  # whole MoE model vs HF grouped_mm
    python -m bench --workloads W11 --impls ours,trl_grpo --tokenizer .gpu/qwen-tokenizer  # GRPO vs TRL
    python -m bench --cpu-smoke --results /tmp/r.jsonl         # tiny end-to-end run on a CPU
    python -m bench --summarize [--merge more.jsonl]           # RESULTS.md from results.jsonl
    python -m bench --dry-run                                  # the plan, nothing built

Every run trains on learnable batches (bench.batches) with one AdamW definition
(lr 1e-3 unless --lr says otherwise) and records each implementation's per-step loss curve.
A speed of ours counts only when the learning check against a stock HF + PEFT (or Liger) curve
of the same run passes (bench.report.learning_check; WORKLOADS.md): so a speed run
that should count includes hf_sdpa, hf_flex, liger_sdpa or liger_flex.

Exit status: 0 when everything asked for ran (peers may be "not supported"), 1 when one of
ours failed (error, OOM) in a speed run, 2 when parity or a learning check failed (a speed
run whose ours curve does not learn like the stock curve of the same run; --parity's
learning check or one-step gradient check).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.report import DEFAULT_MD, DEFAULT_RESULTS, PEER_IMPLS, progress
from bench.runner import setup_for  # noqa: F401  (the setup of an impl name; kept importable here)

DEFAULT_IMPLS = "ours,liger_flex,unsloth,hf_flex,hf_sdpa,liger_sdpa"
# Every name an --impls list may hold: ours, the peers a ratio is taken against (report.PEER_IMPLS),
# "hf" (hf_sdpa's short name) and the slow eager peers that are measured but never the best peer.
KNOWN_IMPLS = ("ours", "hf", *PEER_IMPLS, "hf_eager", "hf_experts_eager")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="comma list of W1..W7, W9 (W5b: GPT-OSS MoE block); default W1,W2,W3 (parity: W1,W2)",
    )
    p.add_argument(
        "--impls",
        default=DEFAULT_IMPLS,
        help=f"comma list, run in this order; known: {', '.join(KNOWN_IMPLS)} (default {DEFAULT_IMPLS}); "
        "on W5/W5b any HF name runs every transformers experts implementation; on W9 hf/hf_sdpa is "
        "HF + PEFT with grouped_mm experts and hf_experts_eager the eager-experts peer",
    )
    p.add_argument(
        "--ours-variants",
        default="all-on",
        help="fast-path ablations of ours: all-on, no-kernels, no-lora-autograd, no-fused-ce, "
        "no-packed-attention, rebuilt-metadata, all-off, offload-single, offload-double, "
        "or field=value[+field=value] over FastPathConfig",
    )
    p.add_argument(
        "--order",
        choices=("impl", "workload"),
        default="impl",
        help="impl: each implementation on every workload before the next (default; the "
        "important ones first under a time budget); workload: one workload at a time",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every implementation N times in this run, interleaved (W1 is host-bound: "
        "its target is the median of 3); RESULTS.md shows the median and the range",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8; --cpu-smoke 2)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate of every implementation (default 1e-3, CPU-tiny 1e-2: the loss "
        "falls within the timed steps on the learnable batches, so the learning check can tell)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; --cpu-smoke 1)")
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="JSON-lines file records are appended to")
    p.add_argument("--md", default=str(DEFAULT_MD), help="RESULTS.md path for --summarize")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="wall-clock budget of the whole command; what does not fit is recorded as skipped",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile two more by op and print where the time goes",
    )
    p.add_argument(
        "--profile-stacks",
        action="store_true",
        help="with --profile: also print the torch ops outside the matmuls by GPU time, each with its "
        "Python stack and input shapes (attributes elementwise kernels; a graphed step hides its ops: "
        "add --ours-variants cuda_graphs=false)",
    )
    p.add_argument(
        "--memory-peak",
        action="store_true",
        help="after the timed steps, one more with the allocator's history on: what is alive at its peak, "
        "by the source line that allocated it (bench/memory_peak.py); with --memcap, every trial of the search",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan (N, ceiling, batches, impls); build nothing")
    p.add_argument("--summarize", action="store_true", help="regenerate RESULTS.md from --results and exit")
    p.add_argument("--merge", default=None, help="with --summarize: first append the records of this file")
    p.add_argument(
        "--parity",
        action="store_true",
        help="the learning check: ours (--learning-variant, default all-on) against stock HF + PEFT "
        "for --learning-steps optimizer steps on the same learnable batches (bf16 on a GPU), "
        "then one step's LoRA gradients against HF + PEFT fp32 (fp32 and bf16, shrunk model)",
    )
    p.add_argument(
        "--learning-steps",
        type=int,
        default=None,
        help="optimizer steps of --parity's learning check (default 30, the WORKLOADS.md minimum)",
    )
    p.add_argument(
        "--learning-layers",
        type=int,
        default=0,
        help="layers of the learning check's model (default 0: the workload's own depth)",
    )
    p.add_argument("--learning-ref", default="hf_sdpa", help="the stock implementation of the learning check")
    p.add_argument("--learning-variant", default="all-on", help="the variant of ours the learning check trains")
    p.add_argument("--parity-layers", type=int, default=2, help="layers of the one-step gradient check's model")
    p.add_argument("--parity-vocab", type=int, default=None, help="shrink the vocabulary for parity")
    p.add_argument("--parity-tokens", type=int, default=2048)
    p.add_argument("--parity-dtypes", default="float32,bfloat16")
    p.add_argument(
        "--parity-bf16-vs-hf",
        action="store_true",
        help="in bf16 also pass when ours is within 1.25x of stock HF + PEFT bf16's own error "
        "against the fp32 reference (the 1e-2 tolerance is strict by default)",
    )
    p.add_argument("--memcap", action="store_true", help="W7: longest single sequence under a memory cap")
    p.add_argument(
        "--memcap-impls",
        default="ours:offload-single",
        help="comma list for --memcap; ours takes a variant after a colon (ours:offload-double); peers: "
        "hf_sdpa, hf_flex, hf_varlen, liger_sdpa, liger_flex, liger_varlen, trl_varlen, trl_liger_varlen "
        "(any trl_* name), unsloth (in a child process, needs --unsloth-site)",
    )
    p.add_argument("--memcap-gib", type=float, default=16.0, help="the per-process CUDA memory cap of --memcap")
    p.add_argument(
        "--memcap-min-tokens",
        type=int,
        default=1024,
        help="the search's shortest length: lengths below it are not tried (a search that starts where an "
        "earlier run left off; equal to --memcap-max-tokens: one trial at that length)",
    )
    p.add_argument(
        "--memcap-max-tokens",
        type=int,
        default=131_072,
        help="the search's longest length (a multiple of 1024; Unsloth's max_seq_length, TRL's max_length)",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny model on the CPU: ours + hf_sdpa for 2 steps, fp32 one-step parity, and a 30-step learning check",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument(
        "--tokenizer",
        default=None,
        help="W11: a folder with Qwen3's tokenizer.json, tokenizer_config.json and chat_template.jinja (the "
        "rewards read the completions as text); default .gpu/qwen-tokenizer, then the conformance cache",
    )
    p.add_argument(
        "--unsloth-site",
        default=None,
        help="unpacked Unsloth bundle (the 'site' folder of .peer/unsloth-site.tgz); default $TUNESMITH_UNSLOTH_SITE",
    )
    # Internal: the Unsloth child process.
    p.add_argument("--child-impl", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    return p


def _list(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def _device(args):
    import torch

    if args.device == "cpu" or args.cpu_smoke:
        return torch.device("cpu")
    if args.device == "cuda" or torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def plan_impls(wl, impls: list[str], variants: list[str]) -> list[tuple[str, dict]]:
    """(impl, options) in run order; "ours" expands to one entry per variant.

    On MoE-block workloads (W5) every HF impl name stands for all of transformers' experts
    implementations (hf_moe_eager, hf_moe_grouped_mm, hf_moe_batched_mm where registered);
    elsewhere "hf" means hf_sdpa. On whole-model MoE workloads (W9) hf_sdpa is built with the
    workload's peer experts implementation (grouped_mm): it keeps the name hf_sdpa, so the
    summary's learning check and best-peer ratio take it as the stock HF + PEFT run it is.
    """
    out: list[tuple[str, dict]] = []
    for impl in impls:
        if impl == "ours":
            entries = [("ours", {"variant": v}) for v in variants]
        elif wl.kind == "moe_block":
            from bench.peers.moe import available_experts_impls

            entries = [
                (f"hf_moe_{name}", {})
                for name in ("eager", "grouped_mm", "batched_mm")
                if name == "eager" or name in available_experts_impls()
            ]
        else:
            name = "hf_sdpa" if impl == "hf" else impl
            opts = {}
            if name == "hf_sdpa" and wl.extra.get("peer_experts"):
                opts = {"experts_implementation": wl.extra["peer_experts"]}
            entries = [(name, opts)]
        out += [e for e in entries if e not in out]
    return out


def base_record(args, env: dict, mode: str = "bench") -> dict:
    from bench.report import now_iso

    return {"date": now_iso(), "run_id": args.run_id, "mode": mode, **env}


def run_speed(args, workloads, impls, variants, device, budget, env) -> list[dict]:
    from bench.batches import describe, make_batches
    from bench.method_batches import METHOD_KINDS, make_method_batches, method_rates
    from bench.method_batches import describe as describe_method
    from bench.peers.unsloth import run_child
    from bench.report import append_record
    from bench.runner import Context, run_impl
    from bench.workloads import ceiling_tokens_per_s, matmul_params

    records = []
    memcaps = [wl for wl in workloads if wl.kind == "memcap"]
    speed = [wl for wl in workloads if wl.kind != "memcap"]
    batches, longest = {}, {}
    for wl in speed:
        if wl.kind in METHOD_KINDS:  # W10, W11: pairs or prompts, not packed documents
            batches[wl.id] = make_method_batches(wl, args.warmup + args.steps)
            longest[wl.id] = 0.0
            progress(f"== {wl.id} {wl.title}: {describe_method(wl)}; AdamW lr {lr_for(wl, args):g}")
            continue
        batches[wl.id] = make_batches(args.warmup + args.steps, wl.tokens, wl.config["vocab_size"], wl.packing)
        docs = sum(len(b.lengths) for b in batches[wl.id]) / len(batches[wl.id])
        longest[wl.id] = 0.0
        progress(
            f"== {wl.id} {wl.title}: {wl.tokens} tokens/step, {docs:.1f} documents/step, "
            f"N={matmul_params(wl) / 1e9:.3f}B, ceiling {ceiling_tokens_per_s(wl):,.0f} tokens/s; "
            f"learnable ids (loss floor {describe(wl.config['vocab_size'])['entropy_floor']} nats), "
            f"AdamW lr {lr_for(wl, args):g}"
        )
    # Impl-major by default: under a time budget every workload gets ours and the best peers
    # before any workload gets the slow baselines.
    # Repeats are interleaved (every implementation once, then again), so a drift of the machine
    # during the run touches all of them alike.
    repeats = max(1, args.repeat)
    jobs = [
        (wl, impl, opts, rep)
        for wl in speed
        for rep in range(1, repeats + 1)
        for impl, opts in plan_impls(wl, impls, variants)
    ]
    if args.order == "impl":
        rank = {}
        for wl, impl, opts, _ in jobs:
            rank.setdefault((impl, opts.get("variant")), len(rank))
        jobs.sort(key=lambda j: (j[3], rank[(j[1], j[2].get("variant"))]))
    for wl, impl, options, rep in jobs:
        data = describe_method(wl) if wl.kind in METHOD_KINDS else describe(wl.config["vocab_size"])
        base = dict(base_record(args, env), lr=lr_for(wl, args), data=data)
        if repeats > 1:
            base["repeat"] = rep
        left = budget.remaining()
        need = max(15.0, 0.6 * longest[wl.id])  # a peer rarely takes less than this workload's slowest so far
        if left < need and impl != "unsloth":
            rec = dict(
                base,
                workload=wl.id,
                impl=impl,
                options=options,
                status=f"skipped: time budget ({left:.0f} s left, ~{need:.0f} s needed)",
            )
            progress(f"{wl.id} {impl}: {rec['status']}")
        elif impl == "unsloth":
            if device.type != "cuda":
                rec = dict(
                    base, workload=wl.id, impl=impl, options={}, status="not supported: Unsloth needs a CUDA GPU"
                )
            else:
                rec = run_child(wl.id, args, budget, base, lr=lr_for(wl, args))
            progress(f"{wl.id} unsloth: {rec.get('status')}")
        else:
            ctx = Context(wl, batches[wl.id], device, args.warmup, args.steps, budget, args, lr=lr_for(wl, args))
            rec = run_impl(setup_for(impl, options), ctx, impl, base, options)
        if wl.kind in METHOD_KINDS:
            rec.update(method_rates(wl, rec))
        longest[wl.id] = max(longest[wl.id], rec.get("wall_s") or 0.0)
        if wl.kind == "train" and device.type == "cuda":  # the ceiling is the H200's
            rec["ceiling_tokens_per_s"] = ceiling_tokens_per_s(wl)
            if rec.get("status") == "ok" and rec.get("tokens_per_s"):
                rec["ceiling_fraction"] = rec["tokens_per_s"] / rec["ceiling_tokens_per_s"]
        rec.setdefault("ceiling_fraction", None)
        rec["mode"] = "bench"
        append_record(args.results, rec)
        records.append(rec)
    if memcaps:
        records += run_memcaps(args, memcaps, device, budget, env)
    return records


def run_memcaps(args, workloads, device, budget, env) -> list[dict]:
    """W7's search for each --memcap-impls name: in this process (bench.memcap.memcap_fields),
    or for unsloth in its child process (the same search there), whose record is merged here."""
    from bench.memcap import CUDA_ONLY, memcap_fields
    from bench.peers.unsloth import run_child
    from bench.report import append_record

    records = []
    for wl in workloads:
        for impl in _list(args.memcap_impls):
            lr = lr_for(wl, args)
            rec = dict(
                base_record(args, env, "memcap"),
                workload=wl.id,
                impl=impl,
                lr=lr,
                options={"cap_gib": args.memcap_gib},
            )
            progress(f"== {wl.id} {impl}: memcap search up to {args.memcap_max_tokens} tokens at {args.memcap_gib} GiB")
            if impl != "unsloth":
                rec.update(
                    memcap_fields(
                        wl,
                        impl,
                        device,
                        budget,
                        args.memcap_gib,
                        args.memcap_max_tokens,
                        lr,
                        min_tokens=args.memcap_min_tokens,
                        memory_peak=args.memory_peak,
                    )
                )
            elif device.type != "cuda":
                rec["status"] = f"not supported: {CUDA_ONLY}"
            else:
                rec = run_child(wl.id, args, budget, rec, lr=lr, memcap=True)
            progress(f"{wl.id} {impl} memcap: {rec.get('status')}, longest {rec.get('longest_tokens')} tokens")
            append_record(args.results, rec)
            records.append(rec)
    return records


def lr_for(wl, args) -> float:
    """The learning rate of a workload's runs: --lr, else the workload's own (CPU-tiny's 64-wide
    model needs 1e-2 to fall 0.3 nats in 30 steps), else the recipe's 1e-3."""
    from bench.runner import DEFAULT_LR

    return float(args.lr if args.lr is not None else wl.extra.get("lr", DEFAULT_LR))


def run_learnings(args, workloads, device, budget, env) -> tuple[list[dict], bool]:
    """--parity's learning check, one record per workload; ok is False when any failed."""
    from bench.parity import run_learning
    from bench.report import append_record
    from bench.workloads import shrink

    rows, ok = [], True
    for wl in workloads:
        if wl.kind != "train" and wl.id != "CPU-tiny":
            progress(f"learning: {wl.id} skipped (only training workloads have a loss curve)")
            continue
        model = shrink(wl, args.learning_layers).with_changes(id=wl.id) if args.learning_layers else wl
        steps = args.learning_steps or 30
        progress(
            f"== learning check {wl.id}: ours[{args.learning_variant}] vs {args.learning_ref}, {steps} steps, "
            f"{model.config['num_hidden_layers']} layers, {model.tokens} tokens/step, lr {lr_for(wl, args):g}"
        )
        rec = run_learning(
            model,
            device,
            steps=steps,
            lr=lr_for(wl, args),
            budget=budget,
            base=base_record(args, env, "learning"),
            variant=args.learning_variant,
            ref_impl=args.learning_ref,
            args=args,
        )
        append_record(args.results, rec)
        rows.append(rec)
        ok &= rec["status"].startswith("ok")
    return rows, ok


def run_parities(args, workloads, device, env, dtypes) -> tuple[list[dict], bool]:
    from bench.parity import run_parity
    from bench.report import append_record
    from bench.workloads import shrink

    rows, ok = [], True
    for wl in workloads:
        if wl.kind != "train" and wl.id != "CPU-tiny":
            progress(f"parity: {wl.id} skipped (only dense training workloads have a parity check)")
            continue
        small = wl if wl.id == "CPU-tiny" else shrink(wl, args.parity_layers, args.parity_vocab, args.parity_tokens)
        small = small.with_changes(quant=None)
        for row in run_parity(small, device, dtypes=dtypes, bf16_vs_hf=args.parity_bf16_vs_hf):
            rec = dict(base_record(args, env, "parity"), **row)
            append_record(args.results, rec)
            rows.append(rec)
            ok &= row["status"].startswith("ok")
    return rows, ok


def dry_run(args, workloads, impls, variants) -> int:
    import importlib.util

    from bench.batches import describe, make_batches
    from bench.method_batches import METHOD_KINDS
    from bench.method_batches import describe as describe_method
    from bench.peers.unsloth import find_site
    from bench.workloads import ceiling_tokens_per_s, matmul_params

    print(
        f"steps {args.steps} timed after {args.warmup} warm-up; results -> {args.results}; "
        f"budget {args.max_seconds or 'none'} s",
        flush=True,
    )
    for name in ("liger_kernel", "trl", "bitsandbytes", "unsloth"):
        print(f"  {name}: {'importable' if importlib.util.find_spec(name) else 'not importable here'}", flush=True)
    print(f"  unsloth bundle: {find_site(args.unsloth_site) or 'none (pass --unsloth-site)'}", flush=True)
    for wl in workloads:
        if wl.kind in METHOD_KINDS:  # W10, W11: pairs or prompts (bench.method_batches)
            print(f"{wl.id} {wl.title} [{wl.kind}]: N={matmul_params(wl):,}; target: {wl.target}", flush=True)
            print(f"  data: {describe_method(wl)}; AdamW lr {lr_for(wl, args):g}", flush=True)
            if wl.kind == "grpo":  # W11 reads its completions through Qwen3's tokenizer (bench.grpo_bench)
                from bench.grpo_bench import describe_rewards, tokenizer_dir

                found = tokenizer_dir(args, wl)
                ok = found is not None and (found / "tokenizer.json").is_file()
                print(f"  tokenizer: {found if ok else 'MISSING (docs/GPU.md, W11)'}", flush=True)
                print(f"  rewards: {'; '.join(describe_rewards(wl))}", flush=True)
            print("  impls: " + ", ".join(i for i, _ in plan_impls(wl, impls, variants)), flush=True)
            continue
        batches = make_batches(args.warmup + args.steps, wl.tokens, wl.config["vocab_size"], wl.packing)
        docs = [len(b.lengths) for b in batches]
        print(
            f"{wl.id} {wl.title} [{wl.kind}{', ' + wl.quant if wl.quant else ''}]: N={matmul_params(wl):,} "
            f"ceiling {ceiling_tokens_per_s(wl):,.0f} tokens/s; {wl.tokens} tokens/step, documents/step "
            f"{min(docs)}-{max(docs)} (mean {sum(docs) / len(docs):.1f}); target: {wl.target}",
            flush=True,
        )
        print(f"  data: {describe(wl.config['vocab_size'])}; AdamW lr {lr_for(wl, args):g}", flush=True)
        if wl.kind == "memcap":
            print(f"  memcap impls: {args.memcap_impls}, cap {args.memcap_gib} GiB, up to {args.memcap_max_tokens}")
        else:
            print(
                "  impls: "
                + ", ".join(
                    f"{i}[{o['variant']}]"
                    if o.get("variant")
                    else f"{i}[{o['experts_implementation']} experts]"
                    if o.get("experts_implementation")
                    else i
                    for i, o in plan_impls(wl, impls, variants)
                ),
                flush=True,
            )
    return 0


def merge(src: str, dst: str) -> int:
    from bench.report import append_record, read_records

    have = {json.dumps(r, sort_keys=True) for r in read_records(dst)}
    n = 0
    for r in read_records(src):
        if json.dumps(r, sort_keys=True) not in have:
            append_record(dst, r)
            n += 1
    progress(f"merged {n} new records from {src} into {dst}")
    return n


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.run_id is None:
        args.run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    if args.steps is None:
        args.steps = 2 if args.cpu_smoke else 8
    if args.warmup is None:
        args.warmup = 1 if args.cpu_smoke else 3
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.learning_steps is not None and args.learning_steps < 4:
        raise SystemExit("--learning-steps must be >= 4 (a first step and three to average); WORKLOADS.md asks >= 30")

    if args.child_impl == "unsloth":  # must import unsloth before anything imports transformers (--memcap too)
        from bench.peers.unsloth import child_main

        return child_main(args)

    from bench.report import summarize

    if args.summarize:
        if args.merge:
            merge(args.merge, args.results)
        summarize(args.results, args.md)
        progress(f"wrote {args.md}")
        return 0

    from bench.workloads import CPU_TINY, get_workload

    impls = _list(args.impls)
    for i in impls:
        if i not in KNOWN_IMPLS:
            raise SystemExit(f"unknown impl {i!r}; known: {', '.join(KNOWN_IMPLS)}")
    variants = _list(args.ours_variants) or ["all-on"]
    from bench.ours import variant_fields

    for v in variants:
        variant_fields(v)  # a typo fails now, not after an hour of other runs
    if args.cpu_smoke:
        workloads = [CPU_TINY]
        if args.impls == DEFAULT_IMPLS:
            impls = ["ours", "hf_sdpa"]
    elif args.memcap and not args.workloads:
        workloads = [get_workload("W7")]
    else:
        default = "W1,W2" if args.parity else "W1,W2,W3"
        workloads = [get_workload(w) for w in _list(args.workloads or default)]

    if args.dry_run:
        return dry_run(args, workloads, impls, variants)

    import torch

    from bench.report import environment
    from bench.runner import Budget

    device = _device(args)
    if device.type != "cuda" and not args.cpu_smoke and args.device != "cpu":
        raise SystemExit("no CUDA GPU here: use --cpu-smoke, --dry-run, or --device cpu to force a CPU run")
    budget = Budget(args.max_seconds, start)
    env = environment(args.unsloth_site)
    progress(f"device {env['gpu']}; commit {env['commit']}; versions {env['versions']}; run {args.run_id}")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The smoke's 64-wide model gains nothing from threads, and on a busy small machine
        # (tests in parallel) OpenMP threads waiting for a core make each step seconds long.
        torch.set_num_threads(1 if args.cpu_smoke else max(1, min(4, os.cpu_count() or 1)))
    try:
        return _run(args, workloads, impls, variants, device, budget, env, start)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside a test process


def _run(args, workloads, impls, variants, device, budget, env, start) -> int:
    from bench.report import format_table, learning_verdict, summarize

    records: list[dict] = []
    learning: list[dict] = []
    parity_ok = learning_ok = True
    if args.cpu_smoke:
        records = run_speed(args, workloads, impls, variants, device, budget, env)
        _, parity_ok = run_parities(args, workloads, device, env, ["float32"])
        learning, learning_ok = run_learnings(args, workloads, device, budget, env)
    elif args.parity:
        learning, learning_ok = run_learnings(args, workloads, device, budget, env)
        _, parity_ok = run_parities(args, workloads, device, env, _list(args.parity_dtypes))
    elif args.memcap:
        records = run_memcaps(args, workloads, device, budget, env)
    else:
        records = run_speed(args, workloads, impls, variants, device, budget, env)

    if records:
        print("\n" + format_table(records), flush=True)
    failed = any(
        r["impl"] == "ours" and (r.get("status") == "oom" or str(r.get("status", "")).startswith("error"))
        for r in records
    )
    # A speed run's own learning check: ours against the stock curves of this run.
    unlearned = [
        r
        for r in records
        if r.get("mode") == "bench"
        and r["impl"] == "ours"
        and r.get("status") == "ok"
        and learning_verdict(r, records)["verdict"] == "FAILED"
    ]
    if os.path.abspath(args.results) == os.path.abspath(str(DEFAULT_RESULTS)):
        summarize(args.results, args.md)
    progress(f"records appended to {args.results}; {time.monotonic() - start:.0f} s in all")
    for r in learning:
        print(
            f"LEARNING CHECK {r['workload']} ours[{r.get('variant')}] vs {r.get('ref_impl')}, {r.get('steps')} "
            f"steps: {r['status']}",
            flush=True,
        )
    for r in unlearned:
        from bench.report import impl_label

        print(
            f"LEARNING CHECK FAILED {r['workload']} {impl_label(r)}: {learning_verdict(r, records)['reason']}",
            flush=True,
        )
    if not learning_ok:
        print(
            "LEARNING CHECK FAILED: ours does not learn like stock HF + PEFT on the same batches (or the "
            "check could not decide); see the curves above.",
            flush=True,
        )
    if not parity_ok:
        print(
            "PARITY FAILED: the engine's loss or LoRA gradients differ from HF + PEFT (fp32) beyond the "
            "WORKLOADS.md tolerance (fp32 <= 1e-4, bf16 <= 1e-2); see the parity lines above.",
            flush=True,
        )
    if not (parity_ok and learning_ok) or unlearned:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
