"""The "adapter" export: the run's PEFT adapter as it is (adapter_config.json,
adapter_model.safetensors and the tokenizer files saved beside them), loadable with
`PeftModel.from_pretrained(base, folder)`. A plain copy: needs nothing installed."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine import runs
from engine.export import ExportError, ExportKind, check_json, check_safetensors


def write(source, out: Path, progress=None) -> None:
    for f in sorted(source.adapter.iterdir()):
        if f.is_file():
            if progress:
                progress(f"copying {f.name}")
            shutil.copy2(f, out / f.name)


def check(folder: Path) -> None:
    """Both adapter files are there, the config names a PEFT type, the weights are LoRA tensors."""
    missing = [f for f in runs.ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise ExportError(f"the adapter export lacks {', '.join(missing)}")
    config = check_json(folder / "adapter_config.json")
    if not config.get("peft_type"):
        raise ExportError("adapter_config.json names no peft_type: it is not a PEFT adapter config")
    tensors = check_safetensors(folder / "adapter_model.safetensors")
    if not any("lora_" in name for name in tensors):
        raise ExportError("adapter_model.safetensors holds no LoRA weights")


KIND = ExportKind(
    name="adapter",
    title="adapter",
    label="LoRA adapter (PEFT: adapter_config.json + adapter_model.safetensors)",
    help="folder for the PEFT adapter",
    stage="Writing the LoRA adapter…",
    write=write,
    check=check,
)
