"""The transformers model under a PEFT wrapper: the one place that unwraps a PeftModel, and
where a run's fresh LoRA takes the weights of an earlier adapter (`lora.init_adapter`).

Every part of the engine that patches or reads the causal LM (attention, the per-architecture
patches, offload, the step) works on the transformers model; callers may hand it either that
model or the PeftModel around it.
"""

from __future__ import annotations


def hf_model(model):
    """`model.get_base_model()` for a peft.PeftModel, else `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def init_adapter_path(source: str):
    """The PEFT adapter folder `lora.init_adapter` names: the folder itself, or a run's final
    adapter/, else its latest checkpoint's (engine.runs.adapter_in). A ConfigError naming the
    field when there is none, raised before the run folder is made."""
    from pathlib import Path

    from engine.config import ConfigError
    from engine.runs import ADAPTER_FILES, adapter_in

    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError("lora.init_adapter", f"{path}: no such folder")
    found = adapter_in(path)
    if found is None:
        raise ConfigError(
            "lora.init_adapter",
            f"{path} is not a PEFT adapter ({' and '.join(ADAPTER_FILES)}) nor a run with an adapter or a checkpoint",
        )
    return found


def load_init_adapter(model, folder) -> int:
    """Copy the adapter weights saved in `folder` into `model`'s fresh LoRA (a PeftModel), so a
    run starts where an earlier one ended. The shapes must agree: r, alpha and the target
    modules are checked against the folder's adapter_config.json first (a ConfigError naming
    lora.init_adapter and what differs). Returns the number of tensors loaded.

    Call it before the fast paths are set up and before any forward: no cached copy of the
    adapter weights exists yet, so none can go stale."""
    import json
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from engine.config import ConfigError
    from engine.runs import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    folder = Path(folder)
    saved = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    ours = model.peft_config[model.active_adapter]
    differ = []
    for key in ("r", "lora_alpha"):
        if saved.get(key) != getattr(ours, key):
            differ.append(f"{key} {saved.get(key)} there, {getattr(ours, key)} here")
    theirs = saved.get("target_modules")
    theirs = {theirs} if isinstance(theirs, str) else set(theirs or [])
    mine = {ours.target_modules} if isinstance(ours.target_modules, str) else set(ours.target_modules or [])
    if theirs != mine:
        differ.append(f"target modules {sorted(theirs)} there, {sorted(mine)} here")
    if differ:
        raise ConfigError(
            "lora.init_adapter", f"{folder} does not fit this run's LoRA settings (lora.*): " + "; ".join(differ)
        )
    weights = load_file(str(folder / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if unexpected or missing:
        raise ConfigError(
            "lora.init_adapter",
            f"{folder} does not match this model's adapters: {len(unexpected)} weights it has no place for, "
            f"{len(missing)} adapter weights it lacks (e.g. {(unexpected + missing)[0]})",
        )
    return len(weights)
