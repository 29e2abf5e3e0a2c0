"""Training presets: partial configs in YAML (resources/presets/ from the engine, then
studio/presets/). A preset sets hyperparameters; the model and data the person chose stay."""

from __future__ import annotations

from pathlib import Path

import yaml

STUDIO_PRESETS = Path(__file__).resolve().parent / "presets"
# Keys a preset never overrides: they belong to the Model and Data pages and to the app.
KEEP = {("model", "name_or_path"), ("data", "source"), ("data", "format"), ("data", "columns"),
        ("data", "split"), ("output", "dir")}


def preset_dirs() -> list[Path]:
    dirs = []
    try:
        from engine.resources import PRESETS_DIR

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
