"""The "adapter" export: the run's PEFT adapter as it is (adapter_config.json,
adapter_model.safetensors and the tokenizer files saved beside them), loadable with
`PeftModel.from_pretrained(base, folder)`. A plain copy: needs nothing installed to write; the
self-check loads it with PEFT on the base (engine/export/selfcheck.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine import runs
from engine.export import ExportError, ExportKind, check_json, check_safetensors
from engine.export.selfcheck import Thresholds


def write(source, out: Path, progress=None, **_options) -> None:
    for f in sorted(source.adapter.iterdir()):
        if f.is_file():
            if progress:
                progress(f"copying {f.name}")
            shutil.copy2(f, out / f.name)


def estimate(source, **_options) -> int:
    return sum(f.stat().st_size for f in source.adapter.iterdir() if f.is_file())


def check(folder: Path) -> None:
    """Both adapter files are there, the config names a PEFT type, the weights are LoRA tensors."""
    missing = [f for f in runs.ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise ExportError(f"the adapter export lacks {', '.join(missing)}")
    config = check_json(folder / runs.ADAPTER_CONFIG)
    if not config.get("peft_type"):
        raise ExportError("adapter_config.json names no peft_type: it is not a PEFT adapter config")
    tensors = check_safetensors(folder / runs.ADAPTER_WEIGHTS)
    if not any("lora_" in name for name in tensors):
        raise ExportError("adapter_model.safetensors holds no LoRA weights")


def verify(folder: Path, source, ref, progress=None, **_options):
    """Load the copied adapter with PEFT onto the reference's base (as a second adapter, so the
    base weights are shared) and compare it with the run's own adapter."""
    from engine.export import selfcheck
    from engine.models.loading import quiet_third_party
    from engine.models.lora import keep_lora_targets

    ref.build()
    model = ref.model()
    try:
        with quiet_third_party(), keep_lora_targets(), selfcheck.strict_adapter_load(folder):
            model.load_adapter(str(folder), adapter_name="exported")
    except Exception as exc:  # PEFT raises many types for a bad adapter; all mean "does not load"
        if "exported" in getattr(model, "peft_config", {}):
            model.delete_adapter("exported")
        return selfcheck.failed("adapter", folder, f"PEFT cannot load the exported adapter: {exc}")
    try:
        model.set_adapter("exported")
        tokenizer = ref.tokenizer
        if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            if not tokenizer.chat_template:
                tokenizer.chat_template = ref.tokenizer.chat_template
        runtime = selfcheck.HFRuntime(model, selfcheck.generation_eos(model), tokenizer.pad_token_id)
        v = selfcheck.check_hf(
            "adapter",
            runtime,
            tokenizer,
            selfcheck.generation_eos(model),
            ref,
            folder,
            "the base model",
            KIND.limits(),
            eos_blocking=False,
        )
    finally:
        model.set_adapter("default")
        model.delete_adapter("exported")
    return v


KIND = ExportKind(
    name="adapter",
    title="adapter",
    label="LoRA adapter (PEFT: adapter_config.json + adapter_model.safetensors)",
    help="folder for the PEFT adapter",
    stage="Writing the LoRA adapter…",
    write=write,
    check=check,
    verify=verify,
    estimate=estimate,
    # The same adapter files on the same base in the same precision: equal up to summation order.
    thresholds={"": Thresholds(0.999, 1e-4, 0.001, "the same as the trained model")},
    pushable=True,
)
