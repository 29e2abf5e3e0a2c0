"""Unsloth as a peer, in a child process of the bench.

Unsloth must be imported before transformers, and it patches transformers' classes for the
whole process, so it cannot share the bench's process. The parent runs
``python -m bench --child-impl unsloth --workloads W1 --json-out F`` with the unpacked
bundle (.peer/unsloth-site.tgz, see fetch-peer-unsloth.sh) first on PYTHONPATH, in a scratch
folder (Unsloth writes a compile cache into its working folder), and merges the record.
The child saves the random-weight model and a word-level tokenizer to a folder, loads it with
FastLanguageModel, and times the same batches (packed lengths as an int32 `packed_seq_lengths`),
rebuilt from the same numbers (bench.batches), with the same optimizer definition and
learning rate (--lr); its record carries the parent's run id and its loss curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import progress
from bench.runner import DEFAULT_LR, Budget, Context, NotSupported, Prepared, make_peer_optimizer

REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_SECONDS = 60  # import, model save and reload alone take about this long on the 8B workload


def find_site(explicit: str | None) -> str | None:
    for cand in (explicit, os.environ.get("TUNESMITH_UNSLOTH_SITE")):
        if cand and (Path(cand) / "unsloth").is_dir():
            return str(Path(cand).resolve())
    return None


def run_child(workload_id: str, args, budget: Budget, base: dict, lr: float) -> dict:
    """Run the Unsloth child for one workload; always returns a record."""
    rec = dict(base, workload=workload_id, impl="unsloth", options={})
    site = find_site(getattr(args, "unsloth_site", None))
    if site is None:
        try:
            import importlib.util

            found = importlib.util.find_spec("unsloth") is not None
        except Exception:
            found = False
        if not found:
            rec["status"] = (
                "not supported: no Unsloth here (unpack .peer/unsloth-site.tgz and pass "
                "--unsloth-site DIR or set TUNESMITH_UNSLOTH_SITE)"
            )
            return rec
    remaining = budget.remaining()
    if remaining < MIN_SECONDS:
        rec["status"] = f"skipped: time budget ({remaining:.0f} s left, the Unsloth child needs ~{MIN_SECONDS} s)"
        return rec
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tunesmith-unsloth-") as tmp:
        out_json = Path(tmp) / "record.json"
        cmd = [
            sys.executable,
            "-m",
            "bench",
            "--child-impl",
            "unsloth",
            "--workloads",
            workload_id,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--json-out",
            str(out_json),
            "--lr",
            repr(float(lr)),
        ]
        if args.run_id:  # the child's record belongs to this run: its loss curve is compared within it
            cmd += ["--run-id", args.run_id]
        if budget.deadline is not None:
            cmd += ["--max-seconds", str(int(max(1, remaining - 5)))]
        env = dict(os.environ)
        paths = [p for p in (site, str(REPO_ROOT), env.get("PYTHONPATH")) if p]
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            UNSLOTH_DISABLE_STATISTICS="1",
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
        )
        progress(f"{workload_id} unsloth: child process {' '.join(cmd[1:])}")
        tail: list[str] = []
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        # A child stuck without output (a hang in setup) is killed at the deadline by a watchdog,
        # since the line loop below only wakes up on output.
        watchdog = None
        killed_at_deadline = threading.Event()

        def kill_at_deadline() -> None:
            killed_at_deadline.set()
            proc.kill()

        if budget.deadline is not None:
            watchdog = threading.Timer(max(1.0, budget.remaining() + 10), kill_at_deadline)
            watchdog.daemon = True
            watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"  [unsloth] {line.rstrip()}", flush=True)
                tail = (tail + [line.rstrip()])[-15:]
            rc = proc.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if out_json.exists():
            child = json.loads(out_json.read_text())
            child["wall_s"] = round(time.monotonic() - t0, 2)
            return child
    last = next((ln for ln in reversed(tail) if ln.strip()), "")
    if killed_at_deadline.is_set():
        rec["status"] = (
            f"skipped: time budget (the Unsloth child was stopped at the deadline, "
            f"{time.monotonic() - t0:.0f} s after it started; last line: {last[:200]})"
        )
    else:
        rec["status"] = f"error: the Unsloth child exited with {rc} and no result ({last[:300]})"
    rec["log_tail"] = tail
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    return rec


# -- inside the child ----------------------------------------------------------------------------


def import_unsloth_first() -> str:
    """Import unsloth before anything imports transformers; returns its version."""
    if "transformers" in sys.modules:
        raise RuntimeError("transformers was imported before unsloth in the child")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    import unsloth  # noqa: F401

    return getattr(unsloth, "__version__", None) or "unknown"


def save_model_folder(workload, folder: Path) -> None:
    """Random-weight model + a word-level tokenizer over its vocabulary, saved for from_pretrained."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from bench.workloads import build_model

    base = workload.with_changes(quant=None)  # Unsloth quantizes on load itself
    model = build_model(base, dtype=torch.bfloat16, device=torch.device("cuda"), attn_implementation="sdpa")
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    vocab = workload.config["vocab_size"]
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3")
    fast.save_pretrained(folder)


def setup_unsloth(folder: Path):
    def setup(ctx: Context) -> Prepared:
        import torch
        from unsloth import FastLanguageModel

        wl = ctx.workload
        if ctx.device.type != "cuda":
            raise NotSupported("Unsloth needs a CUDA GPU")
        t0 = time.monotonic()
        save_model_folder(wl, folder)
        save_s = time.monotonic() - t0
        model, _tok = FastLanguageModel.from_pretrained(
            model_name=str(folder),
            max_seq_length=wl.tokens,
            dtype=torch.bfloat16,
            load_in_4bit=wl.quant == "nf4",
            full_finetuning=False,
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=16,
            target_modules=list(wl.lora_targets),
            lora_alpha=16,
            lora_dropout=0.0,
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=0,
            max_seq_length=wl.tokens,
        )
        FastLanguageModel.for_training(model)
        opt, opt_options = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], ctx.lr)
        inputs = []
        for b in ctx.batches:
            inp = b.hf_inputs()
            if len(b.lengths) > 1:  # its packed path; a single document takes its plain causal path
                inp["packed_seq_lengths"] = torch.tensor(b.lengths, dtype=torch.int32)
            inputs.append(inp)

        def step(i):
            inp = {
                k: (v.to(ctx.device, non_blocking=True) if k != "packed_seq_lengths" else v)
                for k, v in inputs[i].items()
            }
            loss = model(**inp, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Prepared(
            step,
            {
                "use_gradient_checkpointing": "unsloth",
                "packed_seq_lengths": "int32 (host)",
                "model_folder_save_s": round(save_s, 1),
                "optimizer": opt_options,
                "lora_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            },
            keep=[model, opt, inputs],
        )

    return setup


def child_main(args) -> int:
    """`--child-impl unsloth`: measure one workload and write the record to --json-out."""
    try:
        version = import_unsloth_first()
        why = None
    except Exception as exc:
        version, why = None, f"not supported: unsloth does not import ({type(exc).__name__}: {str(exc)[:300]})"
    import torch

    from bench.batches import describe, make_batches
    from bench.report import environment, now_iso
    from bench.runner import Context, run_impl
    from bench.workloads import get_workload

    env = environment()
    env["versions"]["unsloth"] = version
    wl = get_workload(args.workloads.split(",")[0])
    lr = float(args.lr if args.lr is not None else wl.extra.get("lr", DEFAULT_LR))
    base = {
        "date": now_iso(),
        "run_id": args.run_id,
        "mode": "bench",
        **env,
        "lr": lr,
        "data": describe(wl.config["vocab_size"]),
    }
    if why is not None:
        rec = dict(base, workload=wl.id, impl="unsloth", options={}, status=why)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        batches = make_batches(args.warmup + args.steps, wl.tokens, wl.config["vocab_size"], wl.packing)
        ctx = Context(wl, batches, device, args.warmup, args.steps, Budget(args.max_seconds), args, lr=lr)
        with tempfile.TemporaryDirectory(prefix="tunesmith-unsloth-model-") as folder:
            rec = run_impl(setup_unsloth(Path(folder)), ctx, "unsloth", base)
        from bench.workloads import ceiling_tokens_per_s

        if rec.get("tokens_per_s"):
            rec["ceiling_fraction"] = rec["tokens_per_s"] / ceiling_tokens_per_s(wl)
    Path(args.json_out).write_text(json.dumps(rec))
    return 0
