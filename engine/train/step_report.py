"""What each optimizer step reports: its fast-path counters (a fallback or a missing fast path said
once) and, every `log_every` steps and at the last, the StepMetrics event (loss, LR, gradient
norm, tokens per second, memory, the card's health, the objective's own metrics) with the
objective's completion samples and the TensorBoard / W&B line.

StepReport keeps the tokens per second it reported, whose median the run's summary gives.
"""

from __future__ import annotations

from engine.counters import Counters, split_counts
from engine.events import CompletionSamples, StepMetrics
from engine.hardware.vram import gpu_health_fields
from engine.train.reporting import Reporter


class StepReport:
    def __init__(
        self,
        objective,
        memory,
        plan,
        scheduler,
        device,
        total: int,
        mem_total: int,
        log_every: int,
        counters: Counters,
        reporter: Reporter,
    ):
        """`memory`: engine.train.recovery.MemorySettings (the fast paths asked for, the
        offloader); `plan`: the step plan (epochs); `mem_total`: the memory beside the metrics
        (the profile's card, or the host's for a CPU run); `counters`: the run's counts, read and
        reset once per step."""
        self.objective, self.memory, self.plan, self.scheduler = objective, memory, plan, scheduler
        self.device, self.total, self.mem_total, self.log_every = device, total, mem_total, log_every
        self.counters, self.reporter = counters, reporter
        self.is_cuda = device.type == "cuda"
        self.tok_per_s: list[float] = []  # one per reported step

    def step(self, step: int, micro: list, normalizer: int, grad_norm, dt: float, sums: dict, loss: float) -> None:
        """Step `step` took `dt` seconds over the micro-batches `micro` with `normalizer`
        trained tokens; `sums`: the objective's metric sums; `loss`: the step's loss."""
        import torch

        device, memory = self.device, self.memory
        ntok = sum(b.num_tokens for b in micro)
        counters = self.counters.reset()
        calls, fallbacks = split_counts(counters)
        self.reporter.say_what_did_not_run(memory.fast, calls, fallbacks, str(device), step)
        if step % self.log_every != 0 and step != self.total:
            return
        self.tok_per_s.append(ntok / dt)
        if self.is_cuda:
            mem = (
                torch.cuda.memory_allocated(device),
                torch.cuda.memory_reserved(device),
                torch.cuda.max_memory_allocated(device),
            )
        else:
            rss = host_rss()
            mem = (rss, rss, rss)
        metrics = StepMetrics(
            step=step,
            total_steps=self.total,
            epoch=self.plan.epoch_at(step),
            loss=loss,
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=float(grad_norm),
            tokens=ntok,
            trained_tokens=normalizer,
            step_seconds=dt,
            tokens_per_second=ntok / dt,
            mem_allocated=mem[0],
            mem_reserved=mem[1],
            mem_peak=mem[2],
            mem_total=self.mem_total,
            device=str(device),
            metadata_builds=counters.get("metadata_builds", 0),
            host_syncs=counters.get("host_syncs", 0),
            offload=memory.offloader.stats.note() if memory.offloader is not None else "",
            fast_path_calls=calls,
            fallbacks=fallbacks,
            metrics=self.objective.step_metrics({k: float(v) for k, v in sums.items()}),
            # The card's utilisation, temperature and power beside its memory (NVML; none on a CPU).
            **(gpu_health_fields(device.index or 0) if self.is_cuda else {}),
        )
        self.reporter.emit(metrics)
        samples = self.objective.step_samples()
        if samples:  # GRPO's completions with their rewards (the Monitor's table)
            self.reporter.emit(CompletionSamples(step, samples))
        if self.reporter.loggers is not None:
            self.reporter.loggers.step(metrics)


def host_rss() -> int:
    """This process's resident memory: a CPU run's memory reading."""
    import psutil

    return psutil.Process().memory_info().rss
