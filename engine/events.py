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


EVENT_TYPES = {
    cls.__name__: cls for cls in (RunStarted, StepMetrics, LogLine, CheckpointSaved, Paused, Resumed, Finished, Failed)
}


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = EVENT_TYPES[d.pop("event")]
    return cls(**d)
