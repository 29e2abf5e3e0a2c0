"""Typed events a `TrainingSession` reports through its `on_event` callback.

They are plain dataclasses with JSON-friendly fields, so the CLI can print them, the studio's
worker can forward them as Qt signals, and the run folder can log them as JSON lines.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Event:
    time: float = field(default_factory=time.time, kw_only=True)

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["event"] = self.kind
        return d


@dataclass
class RunStarted(Event):
    run_dir: str
    config: dict[str, Any]  # the resolved config (RunConfig.to_dict())
    hardware: dict[str, Any]  # engine.hardware profile as a dict
    total_steps: int
    fast_paths: dict[str, str] = field(default_factory=dict)  # name -> "on" or why it is off
    data_summary: dict[str, Any] = field(default_factory=dict)  # examples, rows, efficiency...
    resumed_from_step: int = 0
    # Processes training together under torchrun (1: a single-process run) and how they share
    # the model: "ddp" (each holds it whole) or "fsdp" (each holds a shard); "" for one process.
    world_size: int = 1
    distributed: str = ""


@dataclass
class StepMetrics(Event):
    step: int
    total_steps: int
    epoch: float
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens processed in this optimizer step (all micro-batches)
    trained_tokens: int  # tokens that carried a label
    step_seconds: float
    tokens_per_second: float
    # Memory in bytes: on a GPU, torch's allocated / reserved / peak and the card's total;
    # on a CPU, allocated is the process RSS and the rest mirror it.
    mem_allocated: int = 0
    mem_reserved: int = 0
    mem_peak: int = 0
    mem_total: int = 0
    device: str = "cpu"
    # Packing metadata builds and device-to-host syncs counted during this step.
    metadata_builds: int = 0
    host_syncs: int = 0
    # Offloaded checkpointing in this step: "double", "single", "single (why)"; "" when off.
    offload: str = ""
    # What ran in this step (engine.counters): calls of the fused LoRA Functions, kernel ops by
    # path ("rmsnorm:triton", "rmsnorm:torch", ...), attention backends, MoE grouped calls;
    # non-zero entries only. fallbacks: {"<module kind>: <reason>": count} of patched modules
    # that took their stock forward; empty when none did.
    fast_path_calls: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    # The card's health when the step was logged (NVML: engine.hardware.vram.gpu_health); None on
    # a CPU or where NVML does not say.
    gpu_util: Optional[int] = None  # percent busy
    gpu_temp: Optional[int] = None  # degrees Celsius
    gpu_power: Optional[float] = None  # watts
    # The objective's own metrics of this step (engine.train.objectives: reward margins and
    # accuracy, chosen/rejected log-probs, rewards ...); empty for SFT.
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LogLine(Event):
    message: str
    level: str = "info"  # "info" | "warning" | "error"


@dataclass
class CheckpointSaved(Event):
    step: int
    path: str


@dataclass
class Paused(Event):
    step: int
    # Why the run paused when the person did not ask for it (a full disk); "" when they did.
    reason: str = ""


@dataclass
class Resumed(Event):
    step: int


@dataclass
class Finished(Event):
    run_dir: str
    summary: dict[str, Any]  # steps, final loss, seconds, tokens/s, adapter path, stopped early
    stopped: bool = False


@dataclass
class Failed(Event):
    message: str  # one sentence a person can act on
    detail: str = ""  # the traceback, for the log view
    last_checkpoint: Optional[str] = None


@dataclass
class MemoryAdjusted(Event):
    """The run ran out of memory and changed one setting to fit; nothing was lost. In the
    pre-flight rehearsal (phase "preflight", step 0) before any step; mid-run (phase "step")
    the step's partial gradients were dropped and `step` runs again from its start. Lowering
    the micro-batch keeps the global batch (more micro-batches per step), so the optimisation
    is unchanged. The one change that raises a setting: a pre-flight whose measured peak left
    much of the memory budget unused puts more of the step's rows in a forward
    (setting "micro_batch", after > before), again the same rows per optimizer step."""

    step: int  # the optimizer step (1-based) that runs again; 0 in the pre-flight
    phase: str  # "preflight" | "step"
    setting: str  # "micro_batch" | "gradient_checkpointing" | "offload" | "keep_attention"
    before: Any
    after: Any
    message: str  # one sentence for the window, e.g. "micro-batch 4 → 2 rows: ..."
    rows_per_micro_batch: int = 0  # packed rows per forward now
    micro_batches_per_step: int = 0  # forwards per optimizer step now (the accumulation)


@dataclass
class RolledBack(Event):
    """The loss turned NaN/inf or spiked (above `spike_factor` x the median of recent losses,
    after warm-up): the adapters, optimizer, schedule and RNG went back to the last good state
    (`to_step`) and the learning rate was halved; the steps after it run again."""

    step: int  # the step whose loss was bad
    to_step: int  # the good state the run continues from
    reason: str  # "nan" | "inf" | "spike"
    loss: float
    lr_before: float  # the schedule's peak learning rate before and after
    lr_after: float
    message: str


@dataclass
class DiskFull(Event):
    """A checkpoint (or the final adapter) did not fit on the disk: nothing partial was left,
    the last good checkpoint is kept, and the run pauses (a Paused event follows) until there
    is room (it continues by itself) or the person resumes or stops it."""

    step: int
    path: str  # the folder being written
    mount: str  # the mount point of the disk that is full
    needed: int  # bytes the write needs (estimate, with margin)
    free: int  # bytes free on that disk
    message: str  # the one sentence: which disk, how much needed, how much free
    what: str = "checkpoint"  # "checkpoint" | "adapter"


@dataclass
class PreflightResult(Event):
    """The measured pre-flight: one forward + backward rehearsed on the run's longest
    micro-batch at the settings the run will use (after any MemoryAdjusted changes). Not a
    training step: its gradients were discarded and the RNG restored."""

    peak_bytes: int  # torch's peak allocated on CUDA, plus the optimizer state still to come; 0 on a CPU
    mem_total: int  # the card's memory (0 on a CPU)
    step_seconds: float  # estimated optimizer step time at the run's average step size
    eta_seconds: float  # for the steps left in this run
    rows_per_micro_batch: int
    micro_batches_per_step: int
    gradient_checkpointing: bool
    offload: str  # "off" | "single" | "double"
    tokens: int  # tokens in the rehearsed micro-batch
    device: str
    attempts: int  # rehearsals run (1 when the first settings fitted)
    message: str  # one line for the window


@dataclass
class EvalMetrics(Event):
    """The loss on the held-out examples after optimizer step `step` (no gradients, no RNG,
    the data position untouched), with the best so far. `stopping`: this eval ran out the
    early-stopping patience, and the run ends here with a checkpoint."""

    step: int
    eval_loss: float  # mean loss per trained token over the held-out examples
    tokens: int  # trained tokens the loss is the mean over
    examples: int = 0
    seconds: float = 0.0
    best_loss: float = float("nan")
    best_step: int = 0
    best_checkpoint: Optional[str] = None  # the checkpoint folder of the best eval loss, once written
    evals_without_improvement: int = 0
    stopping: bool = False
    # The objective's own metrics over the held-out examples; empty for SFT.
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class GalleryAnswers(Event):
    """The gallery prompts answered greedily by the model at the checkpoint of `step` (also one
    line each in the run folder's gallery.jsonl)."""

    step: int
    prompts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    checkpoint: Optional[str] = None


@dataclass
class CompletionSamples(Event):
    """GRPO's sampled completions of the step `step` (a log step), each with its prompt, the
    summed reward and each reward function's score: {"prompt", "completion", "reward", <name>...}."""

    step: int
    samples: list[dict] = field(default_factory=list)


EVENT_TYPES = {
    cls.__name__: cls
    for cls in (
        RunStarted,
        StepMetrics,
        LogLine,
        CheckpointSaved,
        Paused,
        Resumed,
        Finished,
        Failed,
        MemoryAdjusted,
        RolledBack,
        DiskFull,
        PreflightResult,
        EvalMetrics,
        GalleryAnswers,
        CompletionSamples,
    )
}


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = EVENT_TYPES[d.pop("event")]
    return cls(**d)
