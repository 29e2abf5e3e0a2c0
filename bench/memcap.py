"""W7: the longest single sequence that trains (one forward + backward + optimizer step) with
the process's CUDA memory capped (torch.cuda.set_per_process_memory_fraction), by binary search
over lengths in multiples of 1024.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Callable

from bench.report import progress
from bench.runner import (
    DEFAULT_LR,
    GIB,
    Budget,
    BudgetExceeded,
    NotSupported,
    is_oom,
    make_ours_optimizer,
    make_peer_optimizer,
)

UNIT = 1024


def search_longest(
    trial: Callable[[int], bool], lo_units: int, hi_units: int, budget: Budget | None = None, unit: int = UNIT
) -> tuple[int, list[dict]]:
    """Largest n*unit in [lo, hi] units with trial(n*unit) true, assuming monotonic; 0 if none.

    Returns (longest tokens, trials in order). Stops early (keeping what it knows) when the
    budget runs out.
    """
    good, bad = lo_units - 1, hi_units + 1
    trials: list[dict] = []
    while bad - good > 1:
        if budget is not None and budget.remaining() <= 0:
            break
        mid = (good + bad) // 2
        t0 = time.monotonic()
        try:
            ok = bool(trial(mid * unit))
        except BudgetExceeded:
            break
        trials.append({"tokens": mid * unit, "ok": ok, "s": round(time.monotonic() - t0, 2)})
        if ok:
            good = mid
        else:
            bad = mid
    return max(0, good) * unit, trials


def _make_step(impl: str, workload, device):
    """(model, step(ids) -> None) for ours or an HF-based peer, on a single-document batch.

    `impl` may name a variant of ours after a colon: "ours:offload-single".
    """
    import torch

    from bench.workloads import build_model

    if impl == "ours" or impl.startswith("ours:"):
        from bench.ours import loss_fn, prepare_ours, variant_fields
        from engine.data.collate import PackedBatch

        fields = variant_fields(impl.split(":", 1)[1]) if ":" in impl else {}
        model = build_model(workload, dtype=torch.bfloat16, device=device, attn_implementation="sdpa")
        prepared, fp = prepare_ours(model, workload, device, fields)
        model = prepared.model
        run, _ = loss_fn(prepared, fp)

        def forward(ids: list[int]):
            batch = PackedBatch.from_documents([ids]).to(device)
            return run(batch)
    elif impl in ("hf_sdpa", "hf_flex", "liger_sdpa", "liger_flex"):
        from peft import get_peft_model

        from bench.peers.hf import apply_liger, peft_config

        attn = "sdpa" if impl.endswith("sdpa") else "flex_attention"
        model = build_model(workload, dtype=torch.bfloat16, device=device, attn_implementation=attn)
        if impl.startswith("liger"):
            apply_liger(model, workload.arch)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, peft_config(workload))
        model.train()

        def forward(ids: list[int]):
            t = torch.tensor(ids, dtype=torch.int64, device=device).unsqueeze(0)
            return model(input_ids=t, labels=t, use_cache=False).loss
    else:
        raise NotSupported(f"memcap supports ours, hf_* and liger_*, not {impl}")
    # The bench's one optimizer definition (memory only: the state is the same either way).
    make_opt = make_ours_optimizer if impl.split(":")[0] == "ours" else make_peer_optimizer
    opt, _ = make_opt([p for p in model.parameters() if p.requires_grad], DEFAULT_LR)

    def step(ids: list[int]) -> None:
        loss = forward(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def run_memcap(
    workload, impl: str, device, budget: Budget, cap_gib: float = 16.0, lo_units: int = 1, hi_units: int = 128
) -> dict:
    """Fields of the memcap record (status, longest_tokens, trials ...)."""
    import torch

    from bench.ours import _need_bnb

    if device.type != "cuda":
        raise NotSupported("the memory-capped search needs a CUDA GPU")
    if device.index is None:  # set_per_process_memory_fraction wants an index, not plain "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    if workload.quant == "nf4":
        _need_bnb(device)
    _model, opt, step = _make_step(impl, workload, device)  # step's closure holds the model
    total = torch.cuda.get_device_properties(device).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    weights_gib = torch.cuda.memory_allocated() / GIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    gen = torch.Generator().manual_seed(7)
    vocab = workload.config["vocab_size"]
    peaks: dict[int, float] = {}

    def trial(n: int) -> bool:
        budget.check(f"memcap trial at {n} tokens")
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        torch.cuda.reset_peak_memory_stats()
        ok, err = True, None
        try:
            step(ids)
            torch.cuda.synchronize()
            peaks[n] = torch.cuda.max_memory_allocated() / GIB
        except Exception as exc:
            if not is_oom(exc):
                raise
            ok, err = False, exc
            traceback.clear_frames(exc.__traceback__)
        del err
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        progress(
            f"{workload.id} {impl} memcap: {n} tokens -> {'ok' if ok else 'OOM'}"
            + (f", peak {peaks[n]:.2f} GiB" if ok else "")
        )
        return ok

    status = "ok"
    try:
        longest, trials = search_longest(trial, lo_units, hi_units, budget)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        _model = opt = step = None  # noqa: F841 - drop the model before freeing memory
        gc.collect()
        torch.cuda.empty_cache()
    if status == "ok" and budget.remaining() <= 0:
        status = "ok (search cut short by the time budget)"
    return {
        "status": status,
        "longest_tokens": longest,
        "trials": trials,
        "cap_gib": cap_gib,
        "peak_gib": peaks.get(longest),
        "weights_gib": round(weights_gib, 2),
        "search_range": [lo_units * UNIT, hi_units * UNIT],
    }
