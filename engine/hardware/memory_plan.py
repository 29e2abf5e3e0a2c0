"""The defaults policy's decisions about the step's memory: the micro-batch target, gradient
checkpointing, rows per micro-batch, activation offload, and the final fit check against the
budget. Each returns its value and the reason for it.
"""

from __future__ import annotations

from typing import Any

from engine.config import AUTO
from engine.hardware.budget import (
    BUSY_TOKENS,
    DOUBLE_BUFFER_EXTRA_UNKNOWN,
    NO_CHECKPOINT_FRACTION,
    Budget,
    Decision,
    Sizer,
    _gib,
    documents_alone,
)
from engine.hardware.profile import GiB, HardwareProfile, MiB
from engine.models import estimate as est


def _token_target(memory: int) -> int:
    """Tokens per micro-batch when the model's size is not known: what keeps a GPU of this size
    busy without crowding it."""
    gib = memory / GiB
    if gib >= 80:
        return 16_384
    if gib >= 40:
        return 8_192
    if gib >= 20:
        return 4_096
    if gib >= 12:
        return 2_048
    return 1_024


def micro_batch_target(rows: Any, seq: int, budget: Budget, info: est.ModelInfo | None, is_demo: bool) -> int:
    """Tokens per micro-batch before fitting them to memory: the user's rows when set; on a GPU
    the kind's ceiling (the micro-batch grows to it while the budget allows)."""
    if rows != AUTO:
        return rows * seq
    if budget.on_gpu:
        if info is None:
            return max(seq, min(budget.rules.max_tokens, _token_target(budget.total)))
        return max(seq, budget.rules.max_tokens)
    small = (info is None and is_demo) or (info is not None and info.num_params < 1e9)
    return 2 * seq if small and seq <= 512 else seq


def checkpointing_default(budget: Budget, size: Sizer, mode: str, target: int, is_demo: bool) -> Decision:
    if size.info is None:
        if budget.on_gpu or not is_demo:
            return True, "model size not known yet; checkpointing keeps activation memory small"
        return False, "CPU with the small bundled demo model: recomputing would only cost time"
    full = size(mode, target, False, "off")
    if full <= NO_CHECKPOINT_FRACTION * budget.memory:
        return False, (
            f"without it a {target}-token micro-batch needs ~{_gib(full)}, under "
            f"{NO_CHECKPOINT_FRACTION:.0%} of the {budget}: skip the recompute"
        )
    return True, (
        f"without it a {target}-token micro-batch needs ~{_gib(full)}, over "
        f"{NO_CHECKPOINT_FRACTION:.0%} of the {budget}"
    )


def offload_off_reason(
    profile: HardwareProfile, budget: Budget, ckpt: bool, info: est.ModelInfo | None = None
) -> str | None:
    """Why activation offload is off whatever the memory, or None when it depends on memory."""
    if not budget.on_gpu:
        return "CPU: activations already live in host memory"
    alone = documents_alone(info)
    if alone:  # engine.train.step installs no offloader for these
        return (
            f"{info.model_type} runs each document of a row as its own forward ({alone}), and offload's "
            "per-layer slots hold one forward's inputs"
        )
    if profile.integrated_memory:
        return (
            "unified memory: the host and the GPU share it, so moving "
            "activations saves nothing (and no double buffering)"
        )
    if not ckpt:
        return "offload moves checkpointed activations; checkpointing is off"
    return None


def _busy_tokens(budget: Budget, seq: int) -> int:
    return max(seq, min(budget.rules.max_tokens, BUSY_TOKENS))


def planned_offload(
    profile: HardwareProfile, budget: Budget, ckpt: bool, size: Sizer | None = None, mode: str = ""
) -> str:
    """The offload the micro-batch is sized with, before `offload_default` settles it beside
    that micro-batch. A datacenter card sizes without offload when a busy micro-batch fits
    without it; the consumer kinds offload whenever they checkpoint."""
    if offload_off_reason(profile, budget, ckpt, size.info if size is not None else None):
        return "off"
    if budget.rules.offload == "when_needed" and size is not None and size.info is not None:
        if size(mode, _busy_tokens(budget, size.seq), ckpt, "off") <= budget.memory:
            return "off"
    return "double"


def _most_rows(budget: Budget, size: Sizer, mode: str, ckpt: bool, offload: str, most: int) -> int:
    """The largest row count in [1, most] whose estimate fits the budget (1 if none does); the
    estimate grows with the tokens, so a bisection finds it."""
    lo, hi = 1, most
    if size(mode, hi * size.seq, ckpt, offload) <= budget.memory:
        return hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if size(mode, mid * size.seq, ckpt, offload) <= budget.memory:
            lo = mid
        else:
            hi = mid
    return lo


def rows_default(budget: Budget, size: Sizer, mode: str, target: int, ckpt: bool, offload: str) -> Decision:
    """Rows per micro-batch. On a GPU with a known model: as many as the budget holds, up to the
    kind's ceiling (filling the budget is what the estimate's pessimism is for); without the
    model: the size-based target; on a CPU: the target, halved until the estimate fits."""
    seq = size.seq
    rows = max(1, target // seq)
    if not budget.on_gpu:
        fits_note = ""
        if size.info is not None:
            while rows > 1 and size(mode, rows * seq, ckpt, offload) > budget.memory:
                rows //= 2
            fits_note = f", ~{_gib(size(mode, rows * seq, ckpt, offload))} estimated"
        return rows, f"{rows} x {seq} = {rows * seq} tokens per micro-batch; {budget.rules.tokens_why}{fits_note}"
    if size.info is None:
        return rows, (
            f"{rows} x {seq} = {rows * seq} tokens per micro-batch; ~{target} tokens suit "
            f"{_gib(budget.total)} {budget.where} (model size not known yet)"
        )
    rows = _most_rows(budget, size, mode, ckpt, offload, rows)
    tokens = rows * seq
    estimate = size(mode, tokens, ckpt, offload)
    head = f"{rows} x {seq} = {tokens} tokens per micro-batch, ~{_gib(estimate)} estimated"
    if estimate > budget.memory:
        return rows, f"{head}: even one row is over the {budget}"
    if rows * seq >= target:
        return rows, f"{head}: the {budget.rules.label} ceiling of {target} tokens ({budget.rules.tokens_why})"
    return rows, f"{head}: the most that fits the {budget} (offload {offload})"


def offload_default(
    profile: HardwareProfile, budget: Budget, size: Sizer, mode: str, tokens: int, ckpt: bool
) -> Decision:
    """Activation offload: off where it cannot help (CPU, unified memory, no checkpointing) and
    on a datacenter card when the micro-batch fits without it; else double-buffered when the
    budget leaves room for the second buffer, else single."""
    off = offload_off_reason(profile, budget, ckpt, size.info)
    if off:
        return "off", off
    rules = budget.rules
    if size.info is not None:
        if rules.offload == "when_needed":
            plain = size(mode, tokens, ckpt, "off")
            if plain <= budget.memory:
                return "off", (
                    f"{rules.label}: a {tokens}-token micro-batch fits without offload (~{_gib(plain)} in the "
                    f"{budget}): no copies to pay for"
                )
            why = f"{rules.label}: without offload a {tokens}-token micro-batch needs ~{_gib(plain)}, over the {budget}"
        else:
            why = f"{rules.label}: checkpointed activations go to host RAM, leaving the card to the micro-batch"
        double = size(mode, tokens, ckpt, "double")
        if double <= budget.memory:
            return "double", f"{why}; with the second buffer ~{_gib(double)} fits, and it hides the copies"
        return "single", (
            f"{why}; the second buffer would need ~{_gib(double)}, over the {budget}: "
            "one buffer, no room for the second"
        )
    # The run's own size is unknown: ask that the card be as free as a plan would leave it
    # (others' use of it is all that can be seen).
    need = int((1 - est.FIT_FRACTION) * profile.total_vram)
    headroom = budget.memory - need
    if headroom >= DOUBLE_BUFFER_EXTRA_UNKNOWN:
        return "double", (
            f"model size not known yet; the {budget} leaves {_gib(headroom)} beyond a typical run; "
            f"the second buffer needs ~{DOUBLE_BUFFER_EXTRA_UNKNOWN / MiB:.0f} MiB and hides the copies"
        )
    return "single", (
        f"model size not known yet; the {budget} leaves only {_gib(max(headroom, 0))} beyond a typical run: "
        "one buffer, no room for the second"
    )


def fit_check(
    size: Sizer, mode: str, tokens: int, ckpt: bool, offload: str, budget: Budget
) -> tuple[int, str, str | None]:
    """The estimate for the settled config, its verdict ("fits" within the budget, "tight" up to
    the whole device, else "will not fit"), and a warning unless it fits."""
    estimate = size(mode, tokens, ckpt, offload)
    if estimate <= budget.memory:
        return estimate, "fits", None
    verdict = "tight" if estimate <= budget.total else "will not fit"
    return (
        estimate,
        verdict,
        (
            f"{size.info.summary()}: ~{_gib(estimate)} estimated, over the {budget} "
            f"({_gib(budget.total)} {budget.where} in all): {verdict}"
            + ("; try a shorter data.max_seq_len or a smaller model" if verdict == "will not fit" else "")
        ),
    )
