"""Training presets: partial configs in YAML (resources/presets/ from the engine, then
studio/presets/). A preset sets hyperparameters; the model and data the person chose stay."""

from __future__ import annotations

from pathlib import Path

import yaml

STUDIO_PRESETS = Path(__file__).resolve().parent / "presets"
# Keys a preset never overrides: they belong to the Model and Data pages and to the app.
KEEP = {
    ("model", "name_or_path"),
    ("data", "source"),
    ("data", "format"),
    ("data", "columns"),
    ("data", "split"),
    ("output", "dir"),
}


def preset_dirs() -> list[Path]:
    dirs = []
    try:
        from engine.api import PRESETS_DIR

        dirs.append(Path(PRESETS_DIR))
    except Exception:  # an engine without bundled resources still has the studio's presets
        pass
    dirs.append(STUDIO_PRESETS)
    return dirs


def list_presets() -> dict[str, Path]:
    """Preset name -> file; the engine's copy wins when both have the same name."""
    found: dict[str, Path] = {}
    for d in preset_dirs():
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def describe(path: Path) -> str:
    """The comment block at the top of a preset file, as a tooltip."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return " ".join(lines)


# The fused LoRA Functions have no dropout: any lora.dropout > 0 keeps q/k/v, o and the MLP on
# PEFT's path (engine.fastpath.lora.lora_unsupported_reason). The window says so wherever the
# value is chosen or the fast paths are listed.
FUSED_LORA_OFF = "fused LoRA: off with dropout > 0"
FUSED_LORA_KEYS = ("fused LoRA QKV", "fused LoRA O", "fused LoRA MLP", "lora_qkv", "lora_o", "lora_mlp")


def lora_dropout(data: dict) -> float:
    """lora.dropout of a (partial) config mapping, 0.0 when absent or unreadable."""
    try:
        return float((data.get("lora") or {}).get("dropout", 0.0) or 0.0)
    except (TypeError, ValueError, AttributeError):
        return 0.0


def dropout_note(dropout: float) -> str:
    """A sentence for the window when `dropout` turns the fused LoRA path off; "" otherwise."""
    if not dropout or dropout <= 0:
        return ""
    return (
        f"LoRA dropout {dropout:g} turns the fused LoRA path off ({FUSED_LORA_OFF}): the q/k/v, o "
        "and MLP projections run PEFT's slower path. Set LoRA dropout to 0 to keep them fused."
    )


def with_dropout(fast_paths: dict, dropout: float) -> dict:
    """A fast-path listing ({name: "on" | why off}) with the fused LoRA entries marked off when
    `dropout` > 0 (the architecture's listing does not know the run's LoRA settings)."""
    if not dropout or dropout <= 0:
        return dict(fast_paths)
    return {
        k: (
            f"off with dropout > 0 (lora.dropout = {dropout:g})"
            if k in FUSED_LORA_KEYS and str(v).startswith("on")
            else v
        )
        for k, v in fast_paths.items()
    }


def load_preset(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of config sections")
    for section, key in KEEP:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    data.pop("auto_fields", None)
    data.pop("auto_reasons", None)
    return data
