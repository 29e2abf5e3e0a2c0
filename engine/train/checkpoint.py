"""Checkpoints: adapter, optimizer, scheduler, RNG states and data position, written atomically.

A checkpoint folder `checkpoints/step-N/` appears only once complete: it is written as
`step-N.tmp` and renamed. `adapter/` inside it is a standard PEFT adapter. Where things lie
in a run folder is engine.runs' business; this module knows what goes inside a checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from engine.fastpath.lora_group import adapters_changed
from engine.runs import ADAPTER, STATE_FILE, RunFolder, publish, tmp_for


def save_checkpoint(folder: Path, model, optimizer, scheduler, step: int, extra: dict, tokenizer=None) -> Path:
    final = Path(folder)
    tmp = tmp_for(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / ADAPTER, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / ADAPTER)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    state = {"step": step, "python_random": _py_state(), **extra}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
    return publish(tmp, final)


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
    weights = load_file(str(ckpt / ADAPTER / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    adapters_changed()  # the fused LoRA path's cached adapter copies are stale now
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"{ckpt}: adapter does not match the model ({len(unexpected)} unexpected weights)")
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return state
