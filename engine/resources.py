"""Where the bundled assets live (demo model, demo data set, presets).

The repository's `resources/` folder sits beside the `engine` package; the project is
installed in editable mode, so the same path works from a checkout and after `pip install -e`.
"""

from __future__ import annotations

from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
DEMO_MODEL_DIR = RESOURCES / "demo_model"
DEMO_DATA_FILE = RESOURCES / "demo_data" / "train.jsonl"
DEMO_HELDOUT_FILE = RESOURCES / "demo_data" / "heldout.jsonl"
PRESETS_DIR = RESOURCES / "presets"
DEMO_PRESET = PRESETS_DIR / "demo.yaml"


def resource_path(*parts: str) -> Path:
    return RESOURCES.joinpath(*parts)
