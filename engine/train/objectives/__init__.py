"""Training objectives by name: `training.method` picks one (engine.train.objectives.base says
what an objective is and when the session calls it). A new method is one module here that
subclasses Objective and registers itself; add its import to `_MODULES`."""

from __future__ import annotations

import importlib

# The objective modules, imported on first use (each registers its classes).
_MODULES = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")

OBJECTIVES: dict[str, type] = {}


def register(cls):
    """Class decorator: make an Objective subclass available as `training.method: <cls.name>`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if OBJECTIVES.get(cls.name, cls) is not cls:
        raise ValueError(f"two objectives are named {cls.name!r}: {OBJECTIVES[cls.name].__name__} and {cls.__name__}")
    OBJECTIVES[cls.name] = cls
    return cls


def known() -> dict[str, type]:
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return OBJECTIVES


def objective_for(config):
    """The objective `config.training.method` names, made for `config`; a ConfigError naming
    the field (and the methods there are) for a name no module registers."""
    from engine.config import ConfigError

    name = config.training.method
    objectives = known()
    if name not in objectives:
        raise ConfigError("training.method", f"no objective is named {name!r}; known: {', '.join(sorted(objectives))}")
    return objectives[name](config)
