"""The "merged" export: the base model with the adapter merged into its weights, saved as 16-bit
safetensors with the tokenizer, so transformers loads it alone (no PEFT, no adapter).

The merge runs in fp32 on the CPU from a full-precision base (a 4-bit run's base is loaded
unquantized), then the result is stored in bf16 (or the run's 16-bit dtype). The tokenizer saved
is the one the run trained with (beside its adapter: it carries the chat template training
rendered with), and generation_config's eos_token_id gets the token that ends an assistant turn
in that template, so the merged model stops where the trained one learned to. The self-check
loads the folder with plain transformers and compares it with the trained model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from engine.export import ExportError, ExportKind, check_json, check_safetensors
from engine.export.selfcheck import SIXTEEN_BIT

DTYPES = ("bfloat16", "float16")


def write(source, out: Path, progress=None, dtype: str = "auto", **_options) -> None:
    import torch
    from peft import PeftModel

    from engine.export.selfcheck import trained_tokenizer
    from engine.models.loading import load_model, quiet_third_party
    from engine.models.lora import keep_lora_targets

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
    with quiet_third_party(), keep_lora_targets():
        model = PeftModel.from_pretrained(base, str(source.adapter))
    if progress:
        progress("merging the adapter")
    merged = model.merge_and_unload()
    merged = merged.to({"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    if progress:
        progress("writing safetensors")
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer = trained_tokenizer(source)
    tokenizer.save_pretrained(out)
    carry_tokenizer_files(source, out, tokenizer)
    stop_at_turn_end(out, tokenizer)


# Tokenizer files save_pretrained may leave out that llama.cpp's converter reads: a SentencePiece
# family's model (Llama-2, Mistral, Phi-3, Gemma) converts from tokenizer.model and nothing else,
# and transformers 5 writes only tokenizer.json.
SIDE_FILES = ("tokenizer.model",)


def tokenizer_folders(source) -> list[Path]:
    """Where the run's tokenizer files are: beside its adapter, then the base model's folder (a
    local folder, or the Hub cache's snapshot of a Hub id; never the network)."""
    from engine.models.loading import resolve_model_source

    folders = [source.adapter]
    try:
        path, local = resolve_model_source(source.config().model.name_or_path)
    except Exception:  # the base is named but gone: the adapter folder is all there is
        return folders
    if local:
        folders.append(Path(path))
    else:
        from huggingface_hub import try_to_load_from_cache

        for name in ("tokenizer_config.json", *SIDE_FILES):
            cached = try_to_load_from_cache(path, name)
            if isinstance(cached, str):
                folders.append(Path(cached).parent)
                break
    return folders


def carry_tokenizer_files(source, out: Path, tokenizer) -> list[str]:
    """Copy SIDE_FILES from the run's tokenizer folders into `out` when save_pretrained did not
    write them, and state in tokenizer_config.json whether the tokenizer adds BOS / EOS itself
    (the converter reads add_bos_token there; without it llama.cpp guesses, and a SentencePiece
    vocabulary then gets a second BOS before the template's literal <s>) and its added tokens.
    Returns the files copied."""
    copied = []
    for name in SIDE_FILES:
        if (out / name).is_file():
            continue
        for folder in tokenizer_folders(source):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
                copied.append(name)
                break
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(special_token_flags(tokenizer))
    listed = set(tokenizer.all_special_tokens)
    unlisted = [t.content for _, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special]
    unlisted = [t for t in unlisted if t not in listed]
    if unlisted and not config.get("extra_special_tokens"):
        # The converter asks the tokenizer which tokens are special (all_special_tokens) to type
        # them control tokens; special added tokens inside the base vocabulary (Gemma's
        # <|turn>) are not among them unless listed here, and llama.cpp then splits them as text.
        config["extra_special_tokens"] = unlisted
    if config.get("tokenizer_class") in (None, GENERIC_CLASS):
        # The converter picks a vocabulary reader by the class the model's repository names
        # (Phi-4: GPT2Tokenizer, read as BPE, else tokenizer.model is required); transformers 5
        # writes its generic class instead.
        for folder in tokenizer_folders(source):
            named = _tokenizer_class(folder)
            if named not in (None, GENERIC_CLASS):
                config["tokenizer_class"] = named
                break
    if not config.get("added_tokens_decoder"):
        # A SentencePiece vocabulary is converted from tokenizer.model plus the tokens listed here
        # (<start_of_turn>, [INST], ...); transformers 5 keeps them in tokenizer.json only.
        config["added_tokens_decoder"] = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(tokenizer.added_tokens_decoder.items())
        }
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return copied


GENERIC_CLASS = "TokenizersBackend"  # what transformers 5 saves for any tokenizer.json tokenizer


def _tokenizer_class(folder: Path) -> Optional[str]:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def special_token_flags(tokenizer) -> dict:
    """add_bos_token / add_eos_token as the tokenizer behaves: whether encoding a text with
    special tokens puts its BOS first / its EOS last."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {
        "add_bos_token": bos is not None and len(full) > len(plain) and full[0] == bos,
        "add_eos_token": eos is not None and len(full) > len(plain) and full[-1] == eos,
    }


def stop_at_turn_end(out: Path, tokenizer) -> None:
    """generation_config.json's eos_token_id holds the tokenizer's EOS and the template's turn-end
    token (a base model's config often names only its pre-training EOS, <|endoftext|>, and a
    chat fine-tune of it then never stops at <|im_end|>)."""
    from engine.export.selfcheck import turn_end_token

    path = out / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    eos = config.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    for extra in (tokenizer.eos_token_id, turn_end_token(tokenizer)):
        if extra is not None and extra not in ids:
            ids.append(int(extra))
    if ids:
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def base_parameters(source) -> Optional[int]:
    """The base model's parameter count from its config.json (local folder or the Hub cache),
    or None when it cannot be read without the network."""
    from engine.models.estimate import model_info_from_path
    from engine.models.loading import resolve_model_source

    try:
        path, local = resolve_model_source(source.config().model.name_or_path)
        if not local:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            if not isinstance(cached, str):
                return None
            path = str(Path(cached).parent)
        info = model_info_from_path(path)
    except Exception:  # an estimate only: no estimate, no disk check
        return None
    return info.num_params if info is not None else None


def estimate(source, **_options) -> Optional[int]:
    """16-bit weights plus a little for the tokenizer and configs."""
    params = base_parameters(source)
    return None if params is None else 2 * params + 50_000_000


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


def verify(folder: Path, source, ref, progress=None, **_options):
    """Load the folder with plain transformers (no PEFT) and compare it with the trained model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.export import selfcheck
    from engine.models.loading import quiet_third_party, torch_dtype

    ref.build()
    ref.release()  # its scores are kept; the merged model needs the memory
    device, dtype = selfcheck.check_device()
    if progress:
        progress("self-check: loading the merged model with transformers")
    try:
        with quiet_third_party():
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype(dtype)).to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many types; all mean "does not load"
        return selfcheck.failed("merged", folder, f"transformers cannot load the merged model: {exc}")
    eos = selfcheck.generation_eos(model)
    runtime = selfcheck.HFRuntime(model, eos, tokenizer.pad_token_id)
    return selfcheck.check_hf("merged", runtime, tokenizer, eos, ref, folder, "the merged folder", KIND.limits())


KIND = ExportKind(
    name="merged",
    title="merged model",
    label="Merged 16-bit model (safetensors, loads with transformers alone)",
    help="folder for the merged 16-bit safetensors model",
    stage="Merging the adapter into the base model…",
    write=write,
    check=check,
    verify=verify,
    estimate=estimate,
    requires=("torch", "transformers", "peft", "safetensors"),
    thresholds={"": SIXTEEN_BIT},
    pushable=True,
)
