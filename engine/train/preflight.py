"""The measured pre-flight: before the first step, rehearse one forward + backward on the
longest micro-batch at the run's settings, measure peak memory (CUDA) and time, and lower
settings until it fits (engine.train.recovery); where the measurement shows room the policy's
formula left unused, run the step's rows in fewer, larger forwards (the growth). Not a
training step: gradients dropped, RNG restored, the data plan untouched.
"""

from __future__ import annotations

import time
from typing import Callable

from engine.counters import reset_counters
from engine.data import plural
from engine.events import PreflightResult
from engine.train.recovery import is_oom
from engine.train.step_runner import rng_state, set_rng_state
from engine.train.units import duration, size

# The pre-flight grows an automatic micro-batch while its measured (allocated) peak stays under
# this share of the memory budget: the rest absorbs the allocator's cache and fragmentation.
GROW_FILL = 0.9
# ... and only by at least this factor: a few more rows per forward are not worth a rehearsal.
GROW_MIN = 1.1


class OverTheCard(RuntimeError):
    """The pre-flight's rehearsal fitted, but with AdamW's state still to come the run would
    run out of memory from its second step on, and no setting is left to lower."""


def wanted(mode: str, is_cuda: bool) -> bool:
    return mode == "on" or (mode == "auto" and is_cuda)


class Preflight:
    """`runner`: the StepRunner (its memory settings are what the pre-flight lowers or grows);
    `profile`: the HardwareProfile; `mem_total`: the card's bytes (an emulated card's cap);
    `auto_fields`: the config's fields the policy chose; `faults`: the test seam or None."""

    def __init__(
        self, runner, params, profile, mem_total: int, auto_fields, emit: Callable, log: Callable, faults=None
    ):
        self.runner, self.memory, self.params = runner, runner.memory, params
        self.profile, self.mem_total, self.auto_fields = profile, mem_total, auto_fields
        self._emit, self._log, self.faults = emit, log, faults
        self.device, self.is_cuda = runner.device, runner.is_cuda

    def run(self, steps_left: int) -> None:
        memory, runner = self.memory, self.runner
        rng = rng_state()
        attempts = 0
        while True:
            attempts += 1
            try:
                measured = self.rehearse()
            except Exception as exc:
                change = memory.next_change() if is_oom(exc) else None
                if change is None:
                    raise
                why = "the rehearsal ran out of memory"
            else:
                # The rehearsal fitted, but AdamW's state arrives at the first optimizer step:
                # from the second step on, the same forward would run out of memory.
                peak, card = measured[0], self.mem_total if self.is_cuda else 0
                if self.faults and self.faults.rehearsal_peak:
                    peak = self.faults.rehearsal_peak(memory.attempt(0, memory.rows, True))
                    card = self.faults.card_bytes
                why = over_the_card(peak, self.moments_to_come(), card)
                if not why:
                    break
                change = memory.next_change()
                if change is None:
                    raise OverTheCard(why)
            runner.drop_partial_step()
            memory.apply(change, "preflight", 0, why)
        if attempts == 1:  # nothing had to be lowered: the measurement may show room to spare
            measured, grown = self.grow_to_fill(measured)
            attempts += grown
        runner.optimizer.zero_grad(set_to_none=True)
        set_rng_state(rng)
        reset_counters()
        self.report(attempts, steps_left, *measured)
        if self.is_cuda:
            # From here on the peak is the training steps': a rehearsal of a size that was then
            # dropped must not stand as the run's peak, nor make offload's measured choice of
            # double buffering (engine.fastpath.offload) more careful than the steps need.
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def grow_to_fill(self, measured: tuple[int, float, int]) -> tuple[tuple[int, float, int], int]:
        """Where the policy's formula left much of the memory budget unused (it over-estimates,
        a 4-bit base most), run the step's rows in fewer, larger forwards: the same rows with
        the same loss normaliser, so the optimisation is unchanged and only the memory use and
        speed differ. Only when the micro-batch was the policy's choice; the grown size is
        rehearsed, and dropped again if it does not fit. Returns the measurement to report and
        the extra rehearsals run."""
        import torch

        from engine.hardware import policy

        memory, plan = self.memory, self.runner.plan
        rows, accum = plan.rows_per_mb, plan.grad_accum
        chosen = "training.rows_per_micro_batch" in self.auto_fields
        if not self.is_cuda or accum < 2 or memory.rows != rows or not chosen:
            return measured, 0
        budget = policy.budget_for("cuda", self.profile)
        moments = self.moments_to_come()
        resident = torch.cuda.memory_allocated(self.device) + moments  # weights, adapters, optimizer
        # Rows cost what the rehearsal allocated for them; what the allocator reserved beyond
        # that is cache and fragmentation, which does not grow row by row. Sizing from the
        # reserved peak left a third of a laptop card unused.
        per_row = max(1, (measured[0] + moments - resident) / rows)
        grown_to = grown_rows(resident, per_row, rows, accum, GROW_FILL * budget.memory)
        if grown_to == rows:
            return measured, 0
        before, tries = memory.rows, 0
        # The size is rehearsed, and what the process reserved must stay in the budget (a cap
        # applies to reserved memory). If it does not, halfway back once, then the old size.
        for rows_now in (grown_to, (grown_to + before) // 2):
            if rows_now < GROW_MIN * before:
                break
            tries += 1
            memory.rows = rows_now
            out_of_memory = False
            try:
                grown = self.rehearse()
                if torch.cuda.max_memory_reserved(self.device) + moments <= budget.memory:
                    break
                self._log(f"Pre-flight: {plural(rows_now, 'row')} per forward went over the {budget}")
            except Exception as exc:
                if not is_oom(exc):
                    raise
                out_of_memory = True
            grown = None
            if out_of_memory:  # out of the except block: its traceback held the activations
                self.runner.drop_partial_step()
                self._log(f"Pre-flight: {plural(rows_now, 'row')} per forward ran out of memory")
        if grown is None:
            memory.rows = before
            self._log(f"Pre-flight: kept {plural(before, 'row')} per forward")
            return measured, tries
        change = ("micro_batch", before, memory.rows)
        memory.announce(
            change,
            "preflight",
            0,
            f"micro-batch {before} → {memory.rows} rows ({plural(memory.forwards_per_step(), 'forward')} "
            f"per step, the same {plural(rows * accum, 'row')} per optimizer step)",
            f"the rehearsal measured room in the {budget}",
        )
        return grown, tries

    def rehearse(self) -> tuple[int, float, int]:
        """(peak bytes or 0 on a CPU, seconds of one forward + backward, tokens) on the
        `memory.rows` longest packed rows."""
        import torch

        runner, device = self.runner, self.device
        sizes = runner.row_tokens()
        longest = sorted(range(len(sizes)), key=lambda r: -sizes[r])[: self.memory.rows]
        if self.is_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        # On CUDA the first pass also compiles and autotunes kernels: time a second one.
        seconds, tokens = 0.0, 0
        objective = runner.objective
        for _ in range(2 if self.is_cuda else 1):
            micro = objective.prepare_step(runner.context(0, True), [(len(longest), runner.batch(longest))])
            tokens = sum(b.num_tokens for _, b in micro)
            t0 = time.perf_counter()
            runner.forward_backward(micro, objective.normalizer([b for _, b in micro]), 0, rehearsal=True)
            runner.optimizer.zero_grad(set_to_none=True)
            if self.is_cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) if self.is_cuda else 0
        return peak, seconds, tokens

    def moments_to_come(self) -> int:
        """Bytes of AdamW's two fp32 moments when the optimizer has not made them yet (they
        appear at the first optimizer step, after a rehearsal has measured); 0 once they exist."""
        return 0 if self.runner.optimizer.state else 2 * sum(p.numel() * 4 for p in self.params)

    def report(self, attempts: int, steps_left: int, peak: int, seconds: float, tokens: int) -> None:
        memory = self.memory
        if peak:  # AdamW's moments appear at the first optimizer step: count them now
            peak += self.moments_to_come()
        step_seconds = seconds * self.runner.step_tokens() / max(1, tokens)
        eta = step_seconds * steps_left
        mem_total = self.mem_total if self.is_cuda else 0
        offload = memory.offload_mode
        peak_text = f"peak {size(peak)} of {size(mem_total)}" if self.is_cuda else "peak not measured on a CPU"
        message = (
            f"Pre-flight: {peak_text}, about {step_seconds:.2f} s per step, ETA {duration(eta)} for "
            f"{plural(steps_left, 'step')} ({plural(memory.rows, 'row')} per forward × {memory.forwards_per_step()} "
            f"per step, checkpointing {'on' if memory.checkpointing else 'off'}, offload {offload})"
        )
        self._log(message)
        self._emit(
            PreflightResult(
                int(peak),
                int(mem_total),
                float(step_seconds),
                float(eta),
                memory.rows,
                memory.forwards_per_step(),
                memory.checkpointing,
                offload,
                int(tokens),
                str(self.device),
                attempts,
                message,
            )
        )


def over_the_card(peak: int, moments: int, card: int) -> str:
    """Why a rehearsal's measured `peak` plus AdamW's `moments` still to come do not fit the
    `card`'s bytes (its cap, for an emulated one), or "" when they do or nothing was measured."""
    if not peak or not card or peak + moments <= card:
        return ""
    return (
        f"its peak, {size(peak)}, and AdamW's state still to come, {size(moments)}, are over the "
        f"{size(card)} of the card"
    )


def grown_rows(resident: float, per_row: float, rows: int, accum: int, target: float) -> int:
    """Rows per forward once the rehearsal measured the memory: as many of the step's
    `rows` x `accum` rows as stay under `target` bytes (`resident` + rows x `per_row`, both
    measured), or `rows` when that is not at least GROW_MIN times more. No token ceiling:
    more rows per forward shortens a step (the same rows in fewer forwards), so pause and stop
    answer as soon as before."""
    fit = int((target - resident) // max(per_row, 1.0))
    most = min(rows * accum, fit)
    return most if most >= GROW_MIN * rows else rows
