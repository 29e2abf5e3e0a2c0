"""Export a run's result: the PEFT adapter, or the base model with the adapter merged in.

`src` is a run folder (its final `adapter/`, else its latest checkpoint) or a checkpoint
folder. Every export is written into a temporary folder beside the destination and renamed
into place at the end, so an interrupted export never leaves something that looks complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ExportError(RuntimeError):
    pass


def find_adapter(src: str | Path) -> Path:
    """The adapter folder inside a run folder, a checkpoint folder, or an adapter folder itself."""
    src = Path(src)
    if not src.exists():
        raise ExportError(f"{src} does not exist")
    candidates = [src, src / "adapter"]
    ckpts = src / "checkpoints"
    if ckpts.is_dir():
        from engine.train.checkpoint import latest_checkpoint

        latest = latest_checkpoint(src)
        if latest is not None:
            candidates.append(latest / "adapter")
    for c in candidates:
        if all((c / f).is_file() for f in ADAPTER_FILES):
            return c
    raise ExportError(f"{src} holds no adapter (no adapter_config.json + adapter_model.safetensors)")


def run_config_for(adapter_dir: Path):
    """The RunConfig of the run an adapter belongs to (walks up to the run's config.yaml)."""
    from engine.config import RunConfig

    for parent in [adapter_dir, *adapter_dir.parents][:5]:
        cfg = parent / "config.yaml"
        if cfg.is_file():
            return RunConfig.load(cfg)
    return None


def _atomic_dir(dst: Path, overwrite: bool) -> Path:
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ExportError(f"{dst} already exists and is not empty; choose another folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, dst: Path) -> list[str]:
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())


def export_adapter(src, dst, overwrite: bool = False, progress: Optional[Callable[[str], None]] = None) -> list[str]:
    """Copy the PEFT adapter (config, safetensors weights, tokenizer files). Returns files written."""
    adapter = find_adapter(src)
    dst = Path(dst)
    tmp = _atomic_dir(dst, overwrite)
    try:
        for f in adapter.iterdir():
            if f.is_file():
                if progress:
                    progress(f"copying {f.name}")
                shutil.copy2(f, tmp / f.name)
        return _commit(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_merged(
    src, dst, dtype: str = "auto", overwrite: bool = False, progress: Optional[Callable[[str], None]] = None
) -> list[str]:
    """Merge the adapter into its base model and save 16-bit safetensors that transformers loads."""
    import torch
    from peft import PeftModel

    from engine.models.loading import load_model, load_tokenizer

    adapter = find_adapter(src)
    cfg = run_config_for(adapter)
    if cfg is None:
        raise ExportError(f"cannot find the run's config.yaml above {adapter}, so the base model is unknown")
    if dtype == "auto":
        dtype = "bfloat16" if cfg.model.dtype in ("bfloat16", "float32") else cfg.model.dtype
    model_cfg = cfg.model
    model_cfg.load_in_4bit = False  # merging needs full-precision base weights
    dst = Path(dst)
    tmp = _atomic_dir(dst, overwrite)
    try:
        if progress:
            progress(f"loading base model {model_cfg.name_or_path}")
        # Merge in fp32 for accuracy, then store in 16 bits.
        base = load_model(model_cfg, "cpu", "float32")
        model = PeftModel.from_pretrained(base, str(adapter))
        if progress:
            progress("merging the adapter")
        merged = model.merge_and_unload()
        merged = merged.to({"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
        if progress:
            progress("writing safetensors")
        merged.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(model_cfg).save_pretrained(tmp)
        return _commit(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
