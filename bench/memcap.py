"""W7: the longest single sequence that trains (one forward + backward + optimizer step) with
the process's CUDA memory capped (torch.cuda.set_per_process_memory_fraction), by binary search
over lengths in multiples of 1024.

Implementations (--memcap-impls):

- ours, or a variant of it after a colon (ours:offload-single);
- HF + PEFT and HF + Liger on sdpa, flex attention or torch's varlen flash attention
  (hf_sdpa, hf_flex, hf_varlen, liger_sdpa, liger_flex, liger_varlen; bench.peers.varlen);
- TRL's SFTTrainer with padding-free packing (trl_varlen, trl_liger_varlen, also trl_sdpa,
  trl_flex, trl_liger, trl_liger_flex): the trainer the speed runs build
  (bench.peers.trl_sft.TrlPeer), each trial one packed row of one document through its
  collator and `training_step`;
- unsloth: Unsloth patches transformers for the whole process, so its search runs in a child
  process (bench.peers.unsloth: run_memcaps launches `python -m bench --child-impl unsloth
  --memcap ...`), which loads the model the way Unsloth's users do (4-bit on load for W7,
  max_seq_length the search's longest length, Unsloth's gradient checkpointing) and calls
  `memcap_fields` as the parent does for the others; the parent merges its record.

Every implementation goes through `run_memcap`: the model and optimizer (the bench's one
AdamW definition) are built uncapped; then the cap is set and each trial draws random ids
(seed 7) of the trial's length and runs one step; an OOM is a failed trial (memory freed, the
search goes on), any other exception ends the search as an error. The record: status,
longest_tokens, trials (tokens, ok, seconds), cap_gib, peak_gib (the longest's peak),
weights_gib (allocated before the first trial) and search_range.
"""

from __future__ import annotations

import gc
import sys
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
    PatchGuard,
    is_oom,
    make_ours_optimizer,
    make_peer_optimizer,
    peer_parts,
)

UNIT = 1024
# More than this still allocated after a failed trial's clean-up ends the search (see run_memcap).
# What the step made to keep stays by design (the adapters' cached low-precision weights, the
# attention tables): 0.14 GiB after W7's trial at 196,608 tokens (2026-12-05), where the leak fixed
# in 314c03c had left 5.3-6 GiB; one layer activation of a trial from 32k tokens is 256 MiB or more.
STALE_BYTES = 256 * 2**20
CUDA_ONLY = "the memory-capped search needs a CUDA GPU"
CUT_SHORT = "ok (search cut short by the time budget)"
# What a record written after a trial says until the search's end replaces it (the Unsloth
# child's record when the child is stopped mid-search).
UNFINISHED = "ok (search cut short: the process stopped before the search ended)"


def hi_units_for(max_tokens: int) -> int:
    """The search's upper end, in units, for --memcap-max-tokens."""
    return max(1, int(max_tokens) // UNIT)


def search_longest(
    trial: Callable[[int], bool],
    lo_units: int,
    hi_units: int,
    budget: Budget | None = None,
    unit: int = UNIT,
    stop: Callable[[], bool] | None = None,
) -> tuple[int, list[dict]]:
    """Largest n*unit in [lo, hi] units with trial(n*unit) true, assuming monotonic; 0 if none.

    Returns (longest tokens, trials in order). Stops early (keeping what it knows) when the
    budget runs out or `stop()` says the later trials would not be comparable.
    """
    good, bad = lo_units - 1, hi_units + 1
    trials: list[dict] = []
    while bad - good > 1:
        if budget is not None and budget.remaining() <= 0:
            break
        if stop is not None and stop():
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


def _make_step(impl: str, workload, device, lr: float = DEFAULT_LR, max_tokens: int | None = None):
    """(model, optimizer, step(ids) -> None) of an implementation, on a single-document batch.

    `impl` may name a variant of ours after a colon: "ours:offload-single". `max_tokens` is the
    longest length the step will see (TRL's max_length, Unsloth's max_seq_length).
    """
    import torch

    from bench.workloads import build_model

    max_tokens = max_tokens or workload.tokens
    parts = peer_parts(impl)
    keep = None  # what must live as long as the step (Unsloth's model folder)
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
    elif parts is not None and parts[0] == "trl":
        # TRL's own loop step (training_step, optimizer, scheduler, zero_grad) over the bench's AdamW.
        from bench.peers.trl_sft import single_document_step

        _, attn, liger = parts
        return single_document_step(workload, device, lr, attn, liger, max_tokens)
    elif parts is not None or impl == "unsloth":
        if impl == "unsloth":  # only inside the Unsloth child: it raises NotSupported anywhere else
            from bench.peers.unsloth import load_for_memcap

            attn = None
            model, keep = load_for_memcap(workload, max_tokens)
        else:
            from peft import get_peft_model

            from bench.peers.hf import apply_liger, peft_config

            _, attn, liger = parts
            name = attn
            if attn == "varlen":
                from bench.peers import varlen

                name = varlen.attn_options(device)["attn_implementation"]  # NotSupported says why not
            model = build_model(workload, dtype=torch.bfloat16, device=device, attn_implementation=name)
            if liger:
                apply_liger(model, workload.arch)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model = get_peft_model(model, peft_config(workload))
            model.train()

        def forward(ids: list[int]):
            t = torch.tensor(ids, dtype=torch.int64, device=device).unsqueeze(0)
            extra = {}
            if attn == "varlen":  # the document's boundaries as a flattening collator gives them, on the device
                extra = {
                    k: v.to(device) if hasattr(v, "to") else v for k, v in varlen.varlen_kwargs([len(ids)]).items()
                }
            return model(input_ids=t, labels=t, use_cache=False, **extra).loss
    else:
        raise NotSupported(
            f"memcap has no step for {impl!r}; it runs ours[:variant], hf_/liger_ sdpa|flex|eager|varlen, "
            "trl_[liger_]sdpa|flex|varlen and unsloth"
        )
    # The bench's one optimizer definition (memory only: the state is the same either way).
    if impl.split(":")[0] == "ours":
        opt, _ = make_ours_optimizer(model, lr)
    else:
        opt, _ = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], lr)

    def step(ids: list[int]) -> None:
        _ = keep  # held by the closure: Unsloth's model folder lives as long as its model
        loss = forward(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def run_memcap(
    workload,
    impl: str,
    device,
    budget: Budget,
    cap_gib: float = 16.0,
    lo_units: int = 1,
    hi_units: int = 128,
    lr: float = DEFAULT_LR,
    on_trial: Callable[[dict], None] | None = None,
    memory_peak: bool = False,
) -> dict:
    """Fields of the memcap record (status, longest_tokens, trials ...); raises NotSupported
    when the implementation cannot run here. `on_trial(fields)` gets the record as it stands
    after every trial (status UNFINISHED). With `memory_peak`, every trial runs with the
    allocator's history on and the record keeps each trial's peak breakdown (bench.memory_peak;
    for a trial that ran out of memory, the highest point before the failure)."""
    import torch

    from bench.ours import _need_bnb

    if device.type != "cuda":
        raise NotSupported(CUDA_ONLY)
    if device.index is None:  # set_per_process_memory_fraction wants an index, not plain "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    if workload.quant == "nf4":
        _need_bnb(device)
    # step's closure holds the model; Unsloth's max_seq_length and TRL's max_length: the longest searched
    _model, opt, step = _make_step(impl, workload, device, lr=lr, max_tokens=hi_units * UNIT)
    total = torch.cuda.get_device_properties(device).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    weights_gib = torch.cuda.memory_allocated(device) / GIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    gen = torch.Generator().manual_seed(7)
    vocab = workload.config["vocab_size"]
    peaks: dict[int, float] = {}
    stale: list[str] = []  # why the search stopped early: memory a failed trial left behind
    breakdowns: dict[str, dict] = {}  # tokens -> bench.memory_peak's breakdown, with memory_peak
    done: list[dict] = []  # the trials so far, for on_trial

    def fields(status: str, longest: int, trials: list[dict]) -> dict:
        return {
            "status": status,
            "longest_tokens": longest,
            "trials": trials,
            "cap_gib": cap_gib,
            "peak_gib": peaks.get(longest),
            "weights_gib": round(weights_gib, 2),
            "search_range": [lo_units * UNIT, hi_units * UNIT],
        } | ({"memory_peaks": dict(breakdowns)} if memory_peak else {})

    def trial(n: int) -> bool:
        budget.check(f"memcap trial at {n} tokens")
        before = torch.cuda.memory_allocated(device)
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.monotonic()
        ok, err = True, None
        try:
            if memory_peak:
                from bench.memory_peak import recorded_peak

                with recorded_peak(f"{workload.id} {impl} at {n} tokens", breakdowns.setdefault(str(n), {})):
                    step(ids)
            else:
                step(ids)
            torch.cuda.synchronize(device)
            peaks[n] = torch.cuda.max_memory_allocated(device) / GIB
        except Exception as exc:
            if not is_oom(exc):
                raise
            ok, err = False, exc
            traceback.clear_frames(exc.__traceback__)
        del err
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device) - before
        if not ok and left > STALE_BYTES:
            # Memory the failed step left allocated: a later trial would start with less than this
            # one did, and its out-of-memory would say nothing about its length (seen on the H200:
            # 6 GiB after W7's trial at 212,992 tokens, and every shorter trial then failed).
            stale.append(f"{left / GIB:.2f} GiB stayed allocated after the out-of-memory trial at {n} tokens")
        progress(
            f"{workload.id} {impl} memcap: {n} tokens -> {'ok' if ok else 'OOM'}"
            + (f", peak {peaks[n]:.2f} GiB" if ok else "")
        )
        if on_trial is not None:
            done.append({"tokens": n, "ok": ok, "s": round(time.monotonic() - t0, 2)})
            longest = max([t["tokens"] for t in done if t["ok"]], default=0)
            on_trial(fields(UNFINISHED, longest, list(done)))
        return ok

    try:
        longest, trials = search_longest(trial, lo_units, hi_units, budget, stop=lambda: bool(stale))
        if lo_units > 1 and not any(t["ok"] for t in trials):
            longest = 0  # the lengths below the range were not tried: nothing is known to train
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        _model = opt = step = None  # noqa: F841 - drop the model before freeing memory
        gc.collect()
        torch.cuda.empty_cache()
    if stale:
        return fields(f"ok (search stopped: {stale[0]}; shorter lengths need a fresh process)", longest, trials)
    return fields(CUT_SHORT if budget.remaining() <= 0 else "ok", longest, trials)


def memcap_fields(
    workload,
    impl: str,
    device,
    budget: Budget,
    cap_gib: float,
    max_tokens: int,
    lr: float = DEFAULT_LR,
    on_trial: Callable[[dict], None] | None = None,
    min_tokens: int = UNIT,
    memory_peak: bool = False,
) -> dict:
    """`run_memcap`'s fields for a search from `min_tokens` up to `max_tokens`, or a status that says why there
    are none ("not supported: ...", "error: ..."); never raises. What run_memcaps records for
    the in-process implementations and the Unsloth child for itself."""
    from bench.runner import free_memory

    try:
        with PatchGuard(workload.arch):  # Liger's class-level patches end with its search
            out = run_memcap(
                workload,
                impl,
                device,
                budget,
                cap_gib=cap_gib,
                lo_units=min(hi_units_for(min_tokens), hi_units_for(max_tokens)),
                hi_units=hi_units_for(max_tokens),
                lr=lr,
                on_trial=on_trial,
                memory_peak=memory_peak,
            )
    except NotSupported as exc:
        out = {"status": f"not supported: {exc}"}
    except Exception as exc:
        traceback.print_exc(file=sys.stdout)
        out = {"status": f"error: {type(exc).__name__}: {str(exc).strip()[:300]}"}
        traceback.clear_frames(exc.__traceback__)
    free_memory(device)
    return out
