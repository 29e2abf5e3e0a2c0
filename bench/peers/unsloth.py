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

W7 (--memcap) runs the same way: the parent's run_memcaps launches
``python -m bench --child-impl unsloth --memcap --workloads W7 --memcap-gib G
--memcap-max-tokens N --lr LR --run-id R [--max-seconds S] --json-out F``; the child loads the
model as above (max_seq_length = the search's longest length, 4-bit on load for QLoRA
workloads) and runs bench.memcap's own search (`memcap_fields`: the same cap, ids, trials, OOM
handling and record fields as the in-process implementations). It rewrites its record after
every trial, so a child stopped at the deadline still reports what it found.
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


def child_command(workload_id: str, args, budget: Budget, lr: float, out_json: Path, memcap: bool = False) -> list[str]:
    """The child's command line: a speed run of one workload, or (memcap) W7's search."""
    cmd = [sys.executable, "-m", "bench", "--child-impl", "unsloth", "--workloads", workload_id]
    if memcap:
        cmd += ["--memcap", "--memcap-gib", repr(float(args.memcap_gib)), "--memcap-max-tokens"]
        cmd += [str(int(args.memcap_max_tokens)), "--memcap-min-tokens", str(int(args.memcap_min_tokens))]
    else:
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--json-out", str(out_json), "--lr", repr(float(lr))]
    if args.run_id:  # the child's record belongs to this run: its loss curve is compared within it
        cmd += ["--run-id", args.run_id]
    if budget.deadline is not None:
        cmd += ["--max-seconds", str(int(max(1, budget.remaining() - 5)))]
    return cmd


def run_child(workload_id: str, args, budget: Budget, base: dict, lr: float, memcap: bool = False) -> dict:
    """Run the Unsloth child for one workload (memcap: W7's search); always returns a record.

    A memcap record is `base` (the parent's memcap record: run id, options) updated with the
    child's fields; the run id, workload, impl and mode stay the parent's.
    """
    rec = dict(base, workload=workload_id, impl="unsloth", options=dict(base.get("options") or {}))
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
        cmd = child_command(workload_id, args, budget, lr, out_json, memcap=memcap)
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
            if not memcap:
                return child
            # A memcap child that was stopped leaves the record of its last finished trial.
            if killed_at_deadline.is_set() or rc != 0:
                child["child_exit"] = "stopped at the deadline" if killed_at_deadline.is_set() else rc
            merged = dict(rec)
            merged.update(child)
            merged["options"] = dict(rec["options"], **(child.get("options") or {}))
            merged.update({k: rec[k] for k in ("run_id", "workload", "impl", "mode") if k in rec})
            return merged
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


def load_unsloth_model(wl, folder: Path, max_seq_length: int):
    """The workload's random-weight model saved to `folder` and loaded the way Unsloth's users
    load it: FastLanguageModel.from_pretrained (4-bit on load for QLoRA workloads), its LoRA
    through get_peft_model with Unsloth's gradient checkpointing, in training mode.
    Returns (model, seconds the folder's save took)."""
    import torch
    from unsloth import FastLanguageModel

    t0 = time.monotonic()
    save_model_folder(wl, folder)
    save_s = time.monotonic() - t0
    model, _tok = FastLanguageModel.from_pretrained(
        model_name=str(folder),
        max_seq_length=max_seq_length,
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
        max_seq_length=max_seq_length,
    )
    FastLanguageModel.for_training(model)
    return model, save_s


def load_for_memcap(wl, max_seq_length: int):
    """(model, folder) for bench.memcap's "unsloth" step, inside the child only (unsloth imported
    before transformers); the model folder lives as long as the returned folder object."""
    if "unsloth" not in sys.modules:
        raise NotSupported(
            "Unsloth must be imported before transformers and patches it for the whole process: its "
            "memcap search runs in a child process (`python -m bench --child-impl unsloth --memcap`, "
            "which run_memcaps launches), not in the bench's"
        )
    folder = tempfile.TemporaryDirectory(prefix="tunesmith-unsloth-model-")
    try:
        model, _ = load_unsloth_model(wl, Path(folder.name), max_seq_length)
    except BaseException:
        folder.cleanup()
        raise
    return model, folder


def setup_unsloth(folder: Path):
    def setup(ctx: Context) -> Prepared:
        import torch

        if ctx.device.type != "cuda":
            raise NotSupported("Unsloth needs a CUDA GPU")
        model, save_s = load_unsloth_model(ctx.workload, folder, ctx.workload.tokens)
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


def write_record(path, rec: dict) -> None:
    """Write the child's record whole or not at all (the parent may stop the child at any time)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)


def child_main(args) -> int:
    """`--child-impl unsloth`: measure one workload (or, with --memcap, search W7's longest
    sequence) and write the record to --json-out."""
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
    if args.memcap:
        write_record(args.json_out, memcap_child(args, wl, lr, {"date": now_iso(), "run_id": args.run_id, **env}, why))
        return 0
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
    write_record(args.json_out, rec)
    return 0


def memcap_child(args, wl, lr: float, base: dict, why: str | None) -> dict:
    """The child's W7 record: bench.memcap's search over the Unsloth model (the same code as the
    in-process implementations), rewritten to --json-out after every trial."""
    import torch

    from bench.memcap import UNIT, hi_units_for, memcap_fields

    rec = dict(
        base,
        mode="memcap",
        workload=wl.id,
        impl="unsloth",
        lr=lr,
        options={
            "cap_gib": args.memcap_gib,
            "max_seq_length": hi_units_for(args.memcap_max_tokens) * UNIT,
            "load_in_4bit": wl.quant == "nf4",
            "use_gradient_checkpointing": "unsloth",
        },
    )
    if why is not None:
        return dict(rec, status=why)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = memcap_fields(
        wl,
        "unsloth",
        device,
        Budget(args.max_seconds),
        cap_gib=args.memcap_gib,
        max_tokens=args.memcap_max_tokens,
        min_tokens=args.memcap_min_tokens,
        lr=lr,
        on_trial=lambda partial: write_record(args.json_out, dict(rec, **partial)),
    )
    return dict(rec, **fields)
