"""Writing a run's checkpoints and final adapter, and the wait on a full disk.

Free space is checked against the expected size first; a write that still fails leaves no
`.tmp` (engine.train.checkpoint); the run says which disk, how much is needed and free
(DiskFull), and pauses until there is room (polled) or Resume/Stop. Under FSDP every rank takes
part in gathering the full tensors; rank 0 writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

from engine.events import CheckpointSaved, DiskFull
from engine.runs import publish
from engine.train.units import size


class Saver:
    """`folder`: the RunFolder; `control`: RunControl (the disk-full pause); `emit`, `log`: the
    reporter; `disk_free`: a test's stand-in for engine.train.checkpoint.disk_free, or None."""

    def __init__(
        self,
        folder,
        model,
        optimizer,
        scheduler,
        tokenizer,
        params,
        dist,
        fsdp: bool,
        control,
        emit: Callable,
        log: Callable,
        disk_free=None,
    ):
        self.folder, self.model, self.optimizer, self.scheduler = folder, model, optimizer, scheduler
        self.tokenizer, self.params, self.dist, self.fsdp = tokenizer, params, dist, fsdp
        self.control, self._emit, self._log, self._disk_free = control, emit, log, disk_free
        # Seconds between looks at the free space while paused for a full disk.
        self.poll_seconds = 5.0
        self.last_checkpoint: Optional[Path] = None
        self._last_bytes = 0

    def checkpoint(self, step: int, extra: dict, after_write: Callable[[Path], None] = lambda p: None) -> bool:
        """Write the checkpoint of `step` with `extra` in its state (CheckpointSaved). On a full
        disk: nothing partial is left, the run says so and pauses until there is room, then tries
        again. False when the run was stopped before it could be written (the last good one
        stays). `after_write(path)` runs on rank 0 once it is written; other ranks only record
        where it is."""
        from engine.train import checkpoint as ckpt

        # FSDP: every rank holds shards; all take part in gathering them whole for rank 0.
        adapter_state, optimizer_state = self.full_states(optimizer=True)
        target = self.folder.checkpoint(step)
        if not self.dist.is_main:  # every rank holds the same adapters: rank 0 writes them
            # ... and every rank knows it is written, so all decide alike whether the next
            # checkpoint is due (under FSDP a rank alone here would wait in the gathering).
            self.last_checkpoint = target
            return True

        def write() -> Path:
            return ckpt.save_checkpoint(
                target,
                self.model,
                self.optimizer,
                self.scheduler,
                step,
                extra,
                self.tokenizer,
                adapter_state=adapter_state,
                optimizer_state=optimizer_state,
            )

        need = ckpt.expected_bytes(self.params, self.optimizer, self.tokenizer_bytes(), self._last_bytes)
        path = self.write_with_room(step, target, need, write, "checkpoint")
        if path is None:
            return False
        self._last_bytes = ckpt.folder_bytes(path)
        self.last_checkpoint = path
        self._emit(CheckpointSaved(step, str(path)))
        return True

    def adapter(self, step: int) -> bool:
        """The final adapter, written as adapter.tmp and published; on a full disk the run
        pauses as for a checkpoint. False when stopped before it could be written."""
        from engine.train import checkpoint as ckpt

        folder = self.folder
        adapter_state, _ = self.full_states(optimizer=False)  # FSDP: gathered by every rank
        if not self.dist.is_main:
            return True
        tmp = folder.adapter_tmp

        def write() -> Path:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                ckpt.save_adapter(self.model, tmp, adapter_state)
                self.tokenizer.save_pretrained(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return publish(tmp, folder.adapter)

        adapter = sum(p.numel() * p.element_size() for p in self.params)
        need = int((adapter + self.tokenizer_bytes()) * 1.05) + (1 << 20)
        if self.write_with_room(step, folder.adapter, need, write, "adapter") is None:
            return False
        self._log(f"Adapter saved to {folder.adapter}")
        return True

    def full_states(self, optimizer: bool) -> tuple[Optional[dict], Optional[dict]]:
        """(adapter, optimizer state) as full tensors for an FSDP run, gathered by every rank
        (collectives); (None, None) otherwise: the checkpoint reads the model's own tensors."""
        if not self.fsdp:
            return None, None
        from engine.train import fsdp

        adapter = fsdp.full_adapter_state(self.model)
        return adapter, fsdp.full_optimizer_state(self.optimizer) if optimizer else None

    def tokenizer_bytes(self) -> int:
        """Bytes of the tokenizer files a checkpoint copies (the model folder's files less its
        weights); 0 for a tokenizer from the Hub cache (the estimate's margin covers it)."""
        source = Path(getattr(self.tokenizer, "name_or_path", "") or "")
        if not source.is_dir():
            return 0
        weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
        return sum(f.stat().st_size for f in source.iterdir() if f.is_file() and not f.name.endswith(weights))

    # -- a full disk ---------------------------------------------------------------------------------
    def free(self, path: Path) -> int:
        from engine.train import checkpoint as ckpt

        return int((self._disk_free or ckpt.disk_free)(path))

    def write_with_room(self, step: int, target: Path, need: int, write: Callable[[], Path], what: str):
        """write() once the disk has `need` bytes free for `target`; a write that fails on a full
        disk anyway (the estimate was short) is cleaned up and waited out the same way. The
        written path, or None when the run was stopped while waiting."""
        from engine.train import checkpoint as ckpt

        while True:
            free = self.free(target.parent)
            if free >= need:
                try:
                    return write()
                except Exception as exc:
                    if not ckpt.is_disk_full(exc):
                        raise
                    first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
                    self._log(f"Writing the {what} at step {step} failed: {type(exc).__name__}: {first}", "warning")
                free = self.free(target.parent)
                if free >= need:  # the estimate was short: wait for more than there is now
                    need = free + max(need // 2, 1 << 20)
            if not self.wait_for_disk(step, target, need, free, what):
                return None

    def wait_for_disk(self, step: int, target: Path, need: int, free: int, what: str) -> bool:
        """Say which disk is full and pause until there is room (looked at every poll_seconds)
        or the person resumes; False when the run is to stop instead."""
        from engine.train import checkpoint as ckpt

        last = (
            f" The last good checkpoint is {self.last_checkpoint}."
            if self.last_checkpoint
            else " No checkpoint has been written yet."
        )
        mount = ckpt.mount_of(target)
        sentence = (
            f"The disk at {mount} is full: the {what} at step {step} needs about {size(need)} and {size(free)} is free."
        )
        if self.control.stopping:
            self._log(f"{sentence} The run stops without it.{last}", "warning")
            return False
        message = f"{sentence} The run is paused: free some space and it continues by itself (or press Resume).{last}"
        self._emit(DiskFull(step, str(target), str(mount), int(need), int(free), message, what))
        self._log(message, "warning")

        def room() -> bool:
            try:
                enough = self.free(target.parent) >= need
            except OSError:
                enough = False
            if enough:
                self._log(f"The disk at {mount} has room again")
            return enough

        return self.control.pause_for(step, message, room, self.poll_seconds)
