"""The studio's shared state: the run config being edited, the hardware profile, the last run.

Panels never own a copy of the config: they read and write it here through dotted field
paths ("training.lr"), and listen to `changed` to stay in sync with each other. The config is
kept as a plain dict so the form can hold a value the engine would reject and show the
engine's `ConfigError` next to the field instead of losing the edit.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from PySide6.QtCore import QObject, Signal

from engine.api import ConfigError, RunConfig


def deep_merge(base: dict, update: dict) -> dict:
    """`base` updated by `update`, section by section, as a new dict. `columns` (a column
    mapping) is taken whole, never merged: a new mapping replaces the old one."""
    out = copy.deepcopy(base)
    for key, value in (update or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "columns":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def model_problems(model: dict[str, Any]) -> list[str]:
    """What stops the chosen model from being trained on, one sentence each ([] when nothing
    does): the demo and Hub ids pass (a Hub id is checked when it downloads); a local folder
    needs config.json, weights and a tokenizer (engine.api.check_model_folder)."""
    from engine.api import ModelLoadError, check_model_folder, resolve_model_source

    name = str(model.get("name_or_path") or "").strip()
    if not name:
        return ["no model is chosen: pick one on the Model page"]
    if name == "demo":
        return []
    try:
        source, local = resolve_model_source(name)
    except ModelLoadError as exc:
        return [str(exc)]
    if not local:
        return []
    return check_model_folder(source, allow_pickle=bool(model.get("allow_pickle")))


class StudioState(QObject):
    changed = Signal(str)  # dotted path, or "" when everything changed
    profile_changed = Signal(object)  # engine.api.HardwareProfile
    run_dir_changed = Signal(str)  # a run started or finished in this folder

    def __init__(self, runs_dir: str, parent: Optional[QObject] = None):
        super().__init__(parent)
        self.data: dict[str, Any] = RunConfig().to_dict()
        self.data.pop("auto_fields", None)
        self.data.pop("auto_reasons", None)
        self.data["output"]["dir"] = runs_dir
        self.profile = None
        self.last_run_dir: Optional[str] = None

    # -- access -----------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        node: Any = self.data
        for part in path.split("."):
            node = node[part]
        return node

    def set(self, path: str, value: Any) -> None:
        *parents, leaf = path.split(".")
        node = self.data
        for part in parents:
            node = node.setdefault(part, {})
        if node.get(leaf) == value:
            return
        node[leaf] = copy.deepcopy(value)
        self.changed.emit(path)

    def replace(self, data: dict[str, Any]) -> None:
        """Take a whole config (a preset or a loaded YAML), keeping where runs are written."""
        runs_dir = self.data["output"]["dir"]
        fresh = RunConfig().to_dict()
        fresh.pop("auto_fields", None)
        fresh.pop("auto_reasons", None)
        data = {k: v for k, v in data.items() if k not in ("auto_fields", "auto_reasons")}
        self.data = deep_merge(fresh, data)
        if "dir" not in (data.get("output") or {}):
            self.data["output"]["dir"] = runs_dir
        self.changed.emit("")

    def config(self) -> RunConfig:
        """The config as the engine reads it; raises ConfigError naming the bad field."""
        return RunConfig.from_dict(copy.deepcopy(self.data))

    def error(self) -> Optional[ConfigError]:
        try:
            self.config()
        except ConfigError as exc:
            return exc
        return None

    def set_profile(self, profile) -> None:
        self.profile = profile
        self.profile_changed.emit(profile)

    def resolved(self) -> RunConfig:
        """The config with hardware defaults applied (what a run would use)."""
        cfg = self.config()
        if self.profile is not None:
            from engine.api import apply_defaults

            result = apply_defaults(cfg, self.profile)
            cfg = result if isinstance(result, RunConfig) else cfg
        return cfg
