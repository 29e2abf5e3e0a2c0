"""Checkpoints: adapter, optimizer, scheduler, RNG states and data position, written atomically.

A checkpoint folder `checkpoints/step-N/` appears only once complete: it is written as
`step-N.tmp` and renamed; a write that fails (a full disk) removes the `.tmp` before the error
goes on, so a failed checkpoint never keeps the disk full. `adapter/` inside it is a standard
PEFT adapter. Where things lie in a run folder is engine.runs' business; this module knows what
goes inside a checkpoint, how big it will be (`expected_bytes`), and how to tell a full disk
from other write errors (`is_disk_full`, `disk_free`, `mount_of`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import torch

from engine.runs import (
    ADAPTER,
    ADAPTER_WEIGHTS,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    RunFolder,
    publish,
    tmp_for,
)


def save_checkpoint(
    folder: Path,
    model,
    optimizer,
    scheduler,
    step: int,
    extra: dict,
    tokenizer=None,
    adapter_state: dict | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """`adapter_state` / `optimizer_state`: full tensors gathered beforehand (an FSDP run, where
    the model's and optimizer's own tensors are each rank's shards); None: read them here."""
    final = Path(folder)
    tmp = tmp_for(final)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(tmp, model, optimizer, scheduler, step, extra, tokenizer, adapter_state, optimizer_state)
    except BaseException:
        # A half-written step-N.tmp would keep a full disk full and confuse a resume.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, final)


def _write(tmp: Path, model, optimizer, scheduler, step: int, extra: dict, tokenizer, adapter_state, optimizer_state):
    tmp.mkdir(parents=True)
    save_adapter(model, tmp / ADAPTER, adapter_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / ADAPTER)
    torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / RNG_FILE)
    state = {"step": step, "python_random": _py_state(), **extra}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")


def save_adapter(model, folder: Path, adapter_state: dict | None = None) -> None:
    """A standard PEFT adapter folder; `adapter_state`: the full adapter tensors when the model's
    own are shards (FSDP), named as in model.state_dict()."""
    if adapter_state is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=adapter_state)


def remove_partials(folder: RunFolder) -> list[Path]:
    """Remove what a write cut short left in a run folder (`checkpoints/step-N.tmp`,
    `adapter.tmp`): nothing reads them, and after a full disk they hold the space a resume
    needs. Returns what was removed."""
    found = folder.partials()
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def expected_bytes(params, optimizer, tokenizer_bytes: int = 0, previous: int = 0) -> int:
    """What the next checkpoint will take on disk, with a margin: the adapter weights, the
    optimizer state (AdamW's two moments, counted as such before the first step creates them),
    the tokenizer files and small files; never less than the previous checkpoint took."""
    params = list(params)
    adapter = sum(p.numel() * p.element_size() for p in params)
    state = tensor_bytes(list(optimizer.state.values()))
    if state == 0:
        state = 2 * sum(p.numel() * 4 for p in params)
    estimate = max(adapter + state + tokenizer_bytes + 64 * 1024, previous)
    return int(estimate * 1.05) + (1 << 20)


def disk_free(path: Path) -> int:
    """Free bytes on the disk holding `path` (or its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def mount_of(path: Path) -> Path:
    """The mount point of the disk holding `path`."""
    p = _existing(path).resolve()
    while not os.path.ismount(p) and p.parent != p:
        p = p.parent
    return p


def _existing(path: Path) -> Path:
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# How a full disk reads when it is not an OSError: torch.save's zip writer ("[enforce fail at
# inline_container.cc:...] unexpected pos ..." or "file write failed"), safetensors (an IoError
# "StorageFull" / "No space left on device").
_FULL_TEXT = ("no space left", "unexpected pos", "file write failed", "storagefull", "disk quota exceeded")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an error it came from) says the disk or quota is full."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if any(t in str(exc).lower() for t in _FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)


def _active_adapter(model) -> str:
    name = getattr(model, "active_adapter", "default")
    return name if isinstance(name, str) else "default"


def _py_state():
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def latest_checkpoint(run_dir: Path) -> Path | None:
    return RunFolder(run_dir).latest_checkpoint()


def read_state(ckpt: Path) -> dict:
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text(encoding="utf-8"))


def load_checkpoint(ckpt: Path, model, optimizer, scheduler) -> dict:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    state = read_state(ckpt)
    weights = load_file(str(ckpt / ADAPTER / ADAPTER_WEIGHTS))
    optim_state = torch.load(ckpt / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if _sharded(model):
        # FSDP: each rank takes its shard of the full tensors (the checkpoint may come from any
        # number of processes, sharded or not).
        from engine.train import fsdp

        unexpected = fsdp.load_adapter_state(model, weights, _active_adapter(model))
        fsdp.load_optimizer_state(optimizer, optim_state)
    else:
        result = set_peft_model_state_dict(model, weights)
        unexpected = getattr(result, "unexpected_keys", [])
        optimizer.load_state_dict(optim_state)
    # The engine's optimizer advanced the model's adapter generation as its state loaded
    # (engine.fastpath.lora_group.watch_optimizer): the fused path's cached adapter copies are stale.
    if unexpected:
        raise RuntimeError(f"{ckpt}: adapter does not match the model ({len(unexpected)} unexpected weights)")
    scheduler.load_state_dict(torch.load(ckpt / SCHEDULER_FILE, weights_only=True))
    rng = torch.load(ckpt / RNG_FILE, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return state
