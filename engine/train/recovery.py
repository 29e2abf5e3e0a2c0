"""Out-of-memory recovery: the memory settings a run may lower while it goes, in a fixed order,
and the step's retry.

When a step (or the pre-flight's rehearsal) runs out of memory, its partial gradients are
dropped, the RNG goes back to the step's start, and one setting is lowered, cheapest first:
input embeddings to host memory (an untied table: costs no speed), stop keeping attention
outputs, double -> single offload, a tied table to host memory, half the rows per forward
(each planned micro-batch runs as more, smaller forwards: the step's rows and its token
normalizer are unchanged, so the optimisation is too), tiled MLPs, gradient checkpointing,
offload. Then the step runs again (MemoryAdjusted). The lowered settings are kept in
checkpoints (`state()` / `restore()`), so a resume keeps them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from engine.data import plural
from engine.events import MemoryAdjusted

Change = tuple[str, Any, Any]  # (setting, before, after)


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError that says CUDA (or another backend) ran out
    of memory (older code paths, cuBLAS / cuDNN allocation failures)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "cublas_status_alloc_failed" in text or "cudnn_status_alloc_failed" in text
    )


class MemorySettings:
    """The settings that decide a run's memory and that recovery lowers: rows per forward,
    gradient checkpointing, the offloader, the fast-path report (host embeddings, tiled MLP).

    `rows`: packed rows per forward: the plan's micro-batch, until running out of memory splits
    each planned micro-batch into more, smaller forwards (or the pre-flight found room for more).
    `emit`, `log`: the session's reporter. `several`: the run has several processes (then no
    setting is moved mid-run: the ranks must run the same forwards)."""

    def __init__(self, model, device, config, plan, prepared, emit: Callable, log: Callable, several: bool = False):
        self.model, self.device, self.config, self.plan = model, device, config, plan
        self.offloader, self.fast = prepared.offloader, prepared.report
        self.checkpointing = bool(config.training.gradient_checkpointing)
        self.rows = plan.rows_per_mb
        self._emit, self._log, self._several = emit, log, several
        self.is_cuda = device.type == "cuda"

    # -- what the run does now -------------------------------------------------------------------
    @property
    def offload_mode(self) -> str:
        return self.offloader.mode if self.offloader is not None else "off"

    def forwards_per_step(self) -> int:
        per_mb = self.plan.rows_per_mb
        if self.rows > per_mb:
            return math.ceil(per_mb * self.plan.grad_accum / self.rows)
        return self.plan.grad_accum * math.ceil(per_mb / self.rows)

    def attempt(self, step: int, rows: int, rehearsal: bool) -> dict:
        """The forward about to run, as Faults.oom_when and rehearsal_peak see it."""
        return {
            "step": step,
            "rows": rows,
            "rehearsal": rehearsal,
            "gradient_checkpointing": self.checkpointing,
            "offload": self.offload_mode,
            "host_embeddings": self.fast.get("host_embeddings", "").startswith("on"),
            "tiled_mlp": self.fast.get("tiled_mlp", "").startswith("on"),
        }

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resume does not run out of memory again."""
        return {
            "rows_per_forward": self.rows,
            "gradient_checkpointing": self.checkpointing,
            "offload": self.offload_mode,
            "host_embeddings": bool(self.fast.get("host_embeddings", "").startswith("on")),
            "tiled_mlp": bool(self.fast.get("tiled_mlp", "").startswith("on")),
        }

    def restore(self, saved: dict) -> None:
        """Settings an earlier part of the run lowered to fit (a checkpoint's `state()`)."""
        from engine.train.step import enable_checkpointing, install_offload

        changed = []
        rows = int(saved.get("rows_per_forward", self.rows))
        if rows < self.rows:
            self.rows = rows
            changed.append(f"{plural(rows, 'row')} per forward")
        if saved.get("gradient_checkpointing") and not self.checkpointing:
            self.checkpointing = enable_checkpointing(self.model)
            changed.append("gradient checkpointing")
        if saved.get("host_embeddings") and self.host_embeddings_possible():
            from engine.fastpath.host_embed import move_to_host

            self.fast["host_embeddings"] = move_to_host(self.model, self.device)
            changed.append("input embeddings in host memory")
        if saved.get("tiled_mlp") and self.tiled_mlp_possible():
            from engine.train.step import tile_mlps

            self.fast["tiled_mlp"] = tile_mlps(self.model, self.device)
            changed.append("tiled MLP")
        mode = saved.get("offload", "off")
        if mode != "off" and self.offloader is None and self.checkpointing:
            self.offloader, self.fast["offload"] = install_offload(
                self.model,
                mode,
                self.device,
                bool(self.config.fast_paths.keep_attention),
                self.config.fast_paths.lean_recompute,
            )
            changed.append(f"{mode} offload")
        if changed:
            self._log("Kept what the run lowered to fit in memory: " + ", ".join(changed))

    # -- what to lower -----------------------------------------------------------------------------
    def next_change(self) -> Optional[Change]:
        """(setting, before, after) of the cheapest change left that saves memory, or None."""
        from engine.peft_model import hf_model

        off = self.offloader
        if self.host_embeddings_possible(tied=False):  # costs no speed: first
            return ("host_embeddings", "device", "host")
        if off is not None and off.keep_attention_allowed and off.stats.attention_kept == "kept":
            return ("keep_attention", "kept", "not kept")
        if off is not None and off.mode == "double":
            return ("offload", "double", "single")
        if self.host_embeddings_possible(tied=True):  # a copy of the table per micro-batch
            return ("host_embeddings", "device", "host")
        if self.rows > 1:
            return ("micro_batch", self.rows, self.rows // 2)
        if self.tiled_mlp_possible():
            return ("tiled_mlp", "off", "on")
        if not self.checkpointing and getattr(hf_model(self.model), "supports_gradient_checkpointing", False):
            return ("gradient_checkpointing", False, True)
        if off is None and self.checkpointing:
            return ("offload", "off", "single")
        return None

    def host_embeddings_possible(self, tied: Optional[bool] = None) -> bool:
        """May the embedding table still move to host memory? (auto, one process; `tied`: only
        if the head is (True) or is not (False) tied to it, None either way.)"""
        from engine.fastpath.host_embed import is_tied, why_not

        if self.config.fast_paths.host_embeddings != "auto" or self._several:
            return False
        if tied is not None and is_tied(self.model) != tied:
            return False
        return not why_not(self.model, self.device)

    def tiled_mlp_possible(self) -> bool:
        """May the MLPs still be tiled, and would it help? (auto, one process, rows longer than a tile.)"""
        from engine.fastpath.tiled_mlp import tile_of, tile_tokens
        from engine.models.patches import dense_mlps
        from engine.peft_model import hf_model

        if self.config.fast_paths.tiled_mlp != "auto" or self._several or tile_of(self.model):
            return False
        if not dense_mlps(self.model)[0]:
            return False
        inter = getattr(hf_model(self.model).config, "intermediate_size", 0) or 0
        return self.config.data.max_seq_len * self.rows > tile_tokens(inter)

    def apply(self, change: Change, phase: str, step: int, why: str) -> None:
        """Make `change` (from next_change) and say so (MemoryAdjusted)."""
        from engine.train.step import enable_checkpointing, install_offload

        setting, before, after = change
        if setting == "host_embeddings":
            from engine.fastpath.host_embed import move_to_host

            self.fast["host_embeddings"] = move_to_host(self.model, self.device)
            if self.is_cuda:  # the device table's blocks back to the card (a cap counts reserved)
                import torch

                torch.cuda.empty_cache()
            what = "input embeddings → host memory (" + self.fast["host_embeddings"].removeprefix("on: ") + ")"
        elif setting == "tiled_mlp":
            from engine.train.step import tile_mlps

            self.fast["tiled_mlp"] = tile_mlps(self.model, self.device)
            what = "tiled MLP " + self.fast["tiled_mlp"].split(" in ")[0]
        elif setting == "keep_attention":
            self.offloader.stop_keeping_attention()
            what = "attention outputs are no longer kept for the recompute"
        elif setting == "offload" and before == "double":
            self.offloader.mode = "single"
            self.fast["offload"] = self.fast.get("offload", "").replace("double", "single")
            what = "offload double → single buffer"
        elif setting == "micro_batch":
            self.rows = after
            what = (
                f"micro-batch {before} → {after} {'row' if after == 1 else 'rows'} "
                f"({plural(self.forwards_per_step(), 'forward')} per step, the same "
                f"{plural(self.plan.rows_per_mb * self.plan.grad_accum, 'row')} per optimizer step)"
            )
        elif setting == "gradient_checkpointing":
            self.checkpointing = enable_checkpointing(self.model)
            what = "gradient checkpointing on"
        else:
            self.offloader, self.fast["offload"] = install_offload(
                self.model,
                after,
                self.device,
                bool(self.config.fast_paths.keep_attention),
                self.config.fast_paths.lean_recompute,
            )
            what = f"{after} offload on"
        self.announce(change, phase, step, what, why)

    def announce(self, change: Change, phase: str, step: int, what: str, why: str) -> None:
        setting, before, after = change
        message = f"{what}: {why}."
        self._log(message, "warning")
        self._emit(MemoryAdjusted(step, phase, setting, before, after, message, self.rows, self.forwards_per_step()))

    def advice(self) -> str:
        """What is left to lower after running out of memory: only the settings not already at
        their leanest (telling someone with checkpointing on to turn it on helps nobody)."""
        return oom_advice(self.config, self.rows, self.checkpointing, self.offloader)


def oom_advice(config, rows: Optional[int], checkpointing: bool, offloader) -> str:
    """The settings left to lower, as one sentence; `rows` None when not known yet."""
    advice = []
    if rows is None or rows > 1:
        advice.append("lower training.rows_per_micro_batch" + (f" (now {rows})" if rows else ""))
    advice.append(f"lower data.max_seq_len (now {config.data.max_seq_len})")
    if not checkpointing:
        advice.append("turn on gradient checkpointing")
    elif offloader is None:
        advice.append("turn on activation offload (training.offload: single)")
    if config.model.load_in_4bit is not True:
        advice.append("load the model in 4 bits (model.load_in_4bit: true)")
    if config.lora.r > 16:
        advice.append(f"use a smaller LoRA rank (lora.r, now {config.lora.r})")
    return "; ".join(advice)
