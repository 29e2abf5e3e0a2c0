"""The "merged" export: the base model with the adapter merged into its weights, saved as 16-bit
safetensors with the tokenizer, so transformers loads it alone (no PEFT, no adapter).

The merge runs in fp32 on the CPU from a full-precision base (a 4-bit run's base is loaded
unquantized), then the result is stored in bf16 (or the run's 16-bit dtype)."""

from __future__ import annotations

from pathlib import Path

from engine.export import ExportError, ExportKind, check_json, check_safetensors

DTYPES = ("bfloat16", "float16")


def write(source, out: Path, progress=None, dtype: str = "auto") -> None:
    import torch
    from peft import PeftModel

    from engine.models.loading import load_model, load_tokenizer, quiet_third_party

    cfg = source.config()
    if dtype == "auto":
        dtype = "bfloat16" if cfg.model.dtype in ("bfloat16", "float32", "auto") else cfg.model.dtype
    if dtype not in DTYPES:
        raise ExportError(f"a merged model is stored in {' or '.join(DTYPES)}, not {dtype}")
    model_cfg = cfg.model
    model_cfg.load_in_4bit = False  # merging needs full-precision base weights
    if progress:
        progress(f"loading base model {model_cfg.name_or_path}")
    base = load_model(model_cfg, "cpu", "float32")  # merge in fp32 for accuracy, store in 16 bits
    with quiet_third_party():
        model = PeftModel.from_pretrained(base, str(source.adapter))
    if progress:
        progress("merging the adapter")
    merged = model.merge_and_unload()
    merged = merged.to({"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    if progress:
        progress("writing safetensors")
    merged.save_pretrained(out, safe_serialization=True)
    load_tokenizer(model_cfg).save_pretrained(out)


def check(folder: Path) -> None:
    """config.json, safetensors weights (one file or an index with its shards), tokenizer files,
    and no LoRA tensors left in the weights."""
    check_json(folder / "config.json")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(check_json(index).get("weight_map", {}).values()))
    else:
        shards = [p.name for p in folder.glob("*.safetensors")]
    if not shards:
        raise ExportError("the merged export holds no *.safetensors weights")
    for shard in shards:
        tensors = check_safetensors(folder / shard)
        if any("lora_" in name for name in tensors):
            raise ExportError(f"{shard} still holds LoRA tensors: the adapter was not merged")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ExportError("the merged export has no tokenizer files")


KIND = ExportKind(
    name="merged",
    title="merged model",
    label="Merged 16-bit model (safetensors, loads with transformers alone)",
    help="folder for the merged 16-bit safetensors model",
    stage="Merging the adapter into the base model…",
    write=write,
    check=check,
    requires=("torch", "transformers", "peft", "safetensors"),
)
