"""Run implementations one after another in one process: time them, record them, free them.

An implementation's `setup(ctx)` builds its model and optimizer and returns a `Prepared`
(a step function over batch indices plus facts for the record). `run_impl` times it the
WORKLOADS.md way (warm-up steps, then synchronized wall time per step; median; peak memory
over the timed steps only), turns an OOM or an exception into a record instead of a crash,
and frees everything before the next implementation starts. Class-level monkey patches
(Liger's, or any the engine makes) are undone between implementations by `PatchGuard`.

Every record keeps its per-step `loss_curve` (warm-up steps included): the learning check
(bench.report.learning_check) compares it with a stock HF + PEFT curve of the same run.
Every implementation trains with one optimizer definition (`ADAMW`, `DEFAULT_LR`): the curves
can only be compared when the updates are meant to be the same.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from bench.report import progress

GIB = 1024**3

# The one optimizer of every implementation (WORKLOADS.md, "The common recipe"): AdamW over the
# LoRA parameters with these settings. lr 1e-3 makes the loss fall visibly within a speed run's
# 11 steps on the learnable batches (speed does not depend on it); weight decay 0, torch's
# default betas and eps. Only the implementation (fused kernel or not) may differ, and the
# record says which (options["optimizer"]).
DEFAULT_LR = 1e-3
ADAMW = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def make_peer_optimizer(params, lr: float):
    """AdamW for the peers, set up as stock training does: transformers' Trainer defaults to
    adamw_torch_fused on torch >= 2.8, i.e. the fused kernel on CUDA (torch's default elsewhere)."""
    import torch

    params = list(params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    opt = torch.optim.AdamW(params, lr=lr, fused=True if on_cuda else None, **ADAMW)
    return opt, optimizer_options(opt, "torch.optim.AdamW (as transformers' Trainer default adamw_torch_fused)")


def make_ours_optimizer(model, lr: float):
    """The engine's own optimizer over `model`'s adapters (what a TrainingSession uses), checked
    against ADAMW."""
    from engine.train.optim import make_optimizer

    opt = make_optimizer(model, lr=lr, weight_decay=ADAMW["weight_decay"])
    return opt, optimizer_options(opt, "engine.train.optim.make_optimizer")


def optimizer_options(opt, source: str) -> dict:
    """The record's note on an optimizer; raises when it is not the one definition."""
    d = opt.defaults
    got = {"betas": tuple(d.get("betas", ())), "eps": d.get("eps"), "weight_decay": d.get("weight_decay")}
    if type(opt).__name__ != "AdamW" or got != ADAMW:
        raise RuntimeError(f"{source} made {type(opt).__name__} {got}, not the bench's AdamW {ADAMW}")
    impl = (
        "fused"
        if d.get("fused")
        else "foreach"
        if d.get("foreach")
        else "torch default (foreach on CUDA, for-loop on CPU)"
    )
    return {
        "name": "AdamW",
        "lr": d.get("lr"),
        "betas": list(got["betas"]),
        "eps": got["eps"],
        "weight_decay": got["weight_decay"],
        "implementation": impl,
        "source": source,
    }


class BudgetExceeded(Exception):
    pass


class Budget:
    """Wall-clock budget of the whole command (GPU calls are killed at a hard limit)."""

    def __init__(self, max_seconds: float | None, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.deadline = None if not max_seconds else self.start + max_seconds

    def remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def check(self, what: str) -> None:
        if self.remaining() <= 0:
            raise BudgetExceeded(f"time budget spent during {what}")


@dataclass
class Prepared:
    step: Callable[[int], Any]  # step(i) runs batch i (fwd + bwd + optimizer); returns the loss or None
    options: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # more record fields (e.g. collate time)
    keep: list = field(default_factory=list)  # objects to drop before freeing memory


@dataclass
class Context:
    workload: Any
    batches: list
    device: Any
    warmup: int
    steps: int
    budget: Budget
    args: Any = None
    lr: float = DEFAULT_LR


def sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def free_memory(device=None) -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class PatchGuard:
    """Snapshot transformers' modeling modules (globals and class attributes) and restore them.

    Liger swaps module-level classes and functions (Qwen3RMSNorm, apply_rotary_pos_emb, ...);
    left in place they would silently speed up every later "plain HF" model of the process.
    """

    PREFIXES = (
        "transformers.models.",
        "transformers.integrations.",
        "transformers.loss.",
        "transformers.masking_utils",
        "transformers.modeling_utils",
    )

    def __init__(self, arch: str | None = None):
        self.arch = arch

    def __enter__(self):
        import importlib

        if self.arch:  # load it now so its pristine state is part of the snapshot
            try:
                importlib.import_module(f"transformers.models.{self.arch}.modeling_{self.arch}")
            except Exception:
                pass
        self.saved = {}
        for name, mod in list(sys.modules.items()):
            if mod is None or not name.startswith(self.PREFIXES):
                continue
            g = dict(vars(mod))
            classes = {
                k: dict(v.__dict__)
                for k, v in g.items()
                if isinstance(v, type) and getattr(v, "__module__", None) == name
            }
            self.saved[name] = (mod, g, classes)
        import torch.nn.functional as F

        self.f_saved = dict(vars(F))
        return self

    def __exit__(self, *exc):
        for name, (mod, g, classes) in self.saved.items():
            cur = vars(mod)
            # Only names that existed are put back: new ones (lazy imports, caches) are harmless.
            for k, v in g.items():
                if cur.get(k) is not v:
                    cur[k] = v
            for cname, cdict in classes.items():
                cls = g[cname]
                for k, v in cdict.items():
                    if cls.__dict__.get(k) is not v and k not in ("__dict__", "__weakref__"):
                        try:
                            setattr(cls, k, v)
                        except (AttributeError, TypeError):
                            pass
        import torch.nn.functional as F

        for k, v in self.f_saved.items():
            if vars(F).get(k) is not v:
                setattr(F, k, v)
        return False


def measure(prep: Prepared, ctx: Context, label: str) -> dict:
    """Warm-ups, then timed steps; peak memory over the timed steps only."""
    import torch

    cuda = ctx.device.type == "cuda"
    losses: list[float | None] = []
    times: list[float] = []
    warm_times: list[float] = []
    for i in range(ctx.warmup):
        ctx.budget.check(f"{label} warm-up step {i + 1}")
        t0 = time.perf_counter()
        loss = prep.step(i)
        sync(ctx.device)
        warm_times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
        progress(f"{label} warm-up {i + 1}/{ctx.warmup}: {warm_times[-1]:.3f} s, loss {_f(losses[-1])}")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # The same list object grows with every step: a run stopped by the budget keeps its curve.
    partial = {"warmup_s": warm_times, "losses": losses, "loss_curve": losses, "step_times": times}
    for j in range(ctx.steps):
        try:
            ctx.budget.check(f"{label} timed step {j + 1}")
        except BudgetExceeded as exc:
            exc.partial = partial
            raise
        i = ctx.warmup + j
        sync(ctx.device)
        t0 = time.perf_counter()
        loss = prep.step(i)
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
        progress(f"{label} step {j + 1}/{ctx.steps}: {times[-1]:.3f} s, loss {_f(losses[-1])}")
    out = dict(partial, loss_curve=list(losses))
    tokens = ctx.batches[0].num_tokens if ctx.batches else ctx.workload.tokens
    med = statistics.median(times)
    out.update(
        step_s=med,
        tokens_per_s=tokens / med,
        tokens_per_s_min=tokens / max(times),
        tokens_per_s_max=tokens / min(times),
    )
    if cuda:
        out.update(
            peak_gib=torch.cuda.max_memory_allocated() / GIB, reserved_gib=torch.cuda.max_memory_reserved() / GIB
        )
    else:
        out.update(peak_gib=None, reserved_gib=None)
    known = [x for x in losses if x is not None]
    out.update(first_loss=known[0] if known else None, last_loss=known[-1] if known else None)
    return out


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def run_impl(
    setup: Callable[[Context], Prepared], ctx: Context, impl: str, base: dict, options: dict | None = None
) -> dict:
    """Set up, measure and free one implementation; never raises for its failures."""
    import torch

    label = f"{ctx.workload.id} {impl}" + (
        f"[{options['variant']}]" if options and options.get("variant") not in (None, "all-on") else ""
    )
    rec = dict(base, workload=ctx.workload.id, impl=impl, options=dict(options or {}))
    free_memory(ctx.device)
    t_start = time.monotonic()
    status = "ok"
    prep = None
    try:
        with PatchGuard(ctx.workload.arch):
            progress(f"{label}: setting up")
            prep = setup(ctx)
            rec["options"].update(prep.options)
            rec.update(prep.extra)
            rec["setup_s"] = round(time.monotonic() - t_start, 2)
            progress(f"{label}: set up in {rec['setup_s']} s; options {prep.options}")
            rec.update(measure(prep, ctx, label))
            rec.update(prep.extra)  # again: steps may fill in fields (ours: the offload note)
            if ctx.args is not None and getattr(ctx.args, "profile", False):
                from bench.profile import profile_steps

                rec.update(profile_steps(prep, ctx, label, stacks=bool(getattr(ctx.args, "profile_stacks", False))))
            if ctx.args is not None and getattr(ctx.args, "memory_peak", False):
                from bench.memory_peak import memory_peak_step

                rec.update(memory_peak_step(prep, ctx, label))
    except BudgetExceeded as exc:
        status = f"skipped: {exc}"
        rec.update(getattr(exc, "partial", {}))
    except NotSupported as exc:
        status = f"not supported: {exc}"
    except NotYetSupported as exc:
        status = f"not yet supported: {exc}"
    except Exception as exc:  # one implementation's failure must not end the run
        if is_oom(exc):
            status = "oom"
            rec["error"] = _short(exc)
        else:
            status = f"error: {_short(exc)}"
            traceback.print_exc(file=sys.stdout)
        traceback.clear_frames(exc.__traceback__)  # frames hold the model; let it go
    finally:
        if prep is not None:
            prep.keep.clear()
        prep = None
    if ctx.device.type == "cuda" and status != "ok":
        rec.setdefault("peak_gib", torch.cuda.max_memory_allocated() / GIB)
        rec.setdefault("reserved_gib", torch.cuda.max_memory_reserved() / GIB)
    rec["status"] = status
    rec["wall_s"] = round(time.monotonic() - t_start, 2)
    free_memory(ctx.device)
    if ctx.device.type == "cuda":  # what this implementation left allocated for the next one to carry
        rec["left_allocated_gib"] = torch.cuda.memory_allocated() / GIB
    peak = f", peak {rec['peak_gib']:.2f} GiB" if rec.get("peak_gib") is not None else ""
    speed = f", {rec['tokens_per_s']:,.0f} tokens/s" if status == "ok" and rec.get("tokens_per_s") else ""
    progress(f"{label}: {status}{speed}{peak} ({rec['wall_s']} s)")
    return rec


class NotSupported(Exception):
    """The implementation cannot run here (a missing package, no GPU ...)."""


class NotYetSupported(Exception):
    """The engine does not have this feature yet."""


def setup_for(impl: str, options: dict):
    """The setup function of an implementation name (ours takes options["variant"])."""
    from bench.ours import setup_ours
    from bench.peers.hf import setup_hf
    from bench.peers.moe import setup_moe_block

    if impl == "ours":
        return setup_ours(options.get("variant", "all-on"))
    if impl in DPO_PEERS:  # W10's DPO peers (bench.peers.trl_dpo, bench.peers.liger_dpo)
        if impl == "liger_dpo_varlen":
            from bench.peers.liger_dpo import setup_liger_dpo

            return setup_liger_dpo()
        from bench.peers.trl_dpo import setup_trl_dpo

        return setup_trl_dpo(liger=impl == "trl_dpo_liger")
    if impl == "trl_grpo":  # W11's peer (bench.peers.trl_grpo)
        from bench.peers.trl_grpo import setup_trl_grpo

        return setup_trl_grpo()
    if impl.startswith("hf_moe_"):
        return setup_moe_block(impl[len("hf_moe_") :])
    if impl == "hf_experts_eager" or (impl == "hf_sdpa" and options.get("experts_implementation")):
        # W9: HF + PEFT on the whole MoE model with the experts implementation asked for
        # (plan_impls sets grouped_mm for hf_sdpa there, the peer the target names).
        from bench.peers.moe import setup_hf_moe_model

        return setup_hf_moe_model(options.get("experts_implementation") or impl.removeprefix("hf_experts_"))
    parts = peer_parts(impl)
    if parts is not None:
        family, attn, liger = parts
        if family == "hf":
            return setup_hf(attn, liger=liger)
        from bench.peers.trl_sft import setup_trl

        return setup_trl(attn, liger=liger)
    raise SystemExit(f"unknown impl {impl!r}")


# W10's peers: TRL's DPOTrainer + PEFT (plain, and with Liger's layer kernels), and HF + PEFT with
# Liger's fused DPO loss on varlen flash attention.
DPO_PEERS = ("trl_dpo", "trl_dpo_liger", "liger_dpo_varlen")

PEER_ATTN = {"sdpa": "sdpa", "flex": "flex_attention", "eager": "eager", "varlen": "varlen"}


def peer_parts(impl: str) -> tuple[str, str, bool] | None:
    """(family "hf" or "trl", attention, Liger or not) of an HF-based peer's name; None otherwise.

    hf_sdpa, hf_flex, hf_eager, hf_varlen and liger_* (HF + PEFT, with Liger); trl_sdpa, trl_flex,
    trl_varlen, trl_liger (Liger + sdpa), trl_liger_flex, trl_liger_varlen (TRL's SFTTrainer).
    The attention is transformers' name, or "varlen" (bench.peers.varlen).
    """
    family, _, kind = impl.partition("_")
    if family in ("hf", "liger") and kind in PEER_ATTN:
        return "hf", PEER_ATTN[kind], family == "liger"
    if family == "trl":
        liger = kind == "liger" or kind.startswith("liger_")
        kind = kind.removeprefix("liger").removeprefix("_") or "sdpa"
        if kind in PEER_ATTN and kind != "eager":
            return "trl", PEER_ATTN[kind], liger
    return None
