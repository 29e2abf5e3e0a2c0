"""GRPO's reward functions: the built-ins and the user's own Python file.

Each reward function scores one completion of one prompt, with the data row's other columns at
hand: `fn(prompt, completion, **row) -> float`. Built in:

- `regex`: 1.0 when the stripped completion matches the pattern (re.fullmatch), else 0.0, the
  format reward (the demo's `Answer: (.+)`);
- `exact`: 1.0 when the completion, or the pattern's first group when a pattern is given, equals
  the row's column (both stripped), else 0.0;
- `length`: 0 up to `max_chars` characters, then minus the share over it.

A `python` reward loads the user's file and calls its `reward` function. That runs the user's
code in this process, with this process's rights: the window says so where the file is picked.
A failing call names the file, the prompt's row and the error; so does a value that is not a
finite number.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.data import shown_row


class RewardError(ValueError):
    """A reward function that cannot be loaded or did not return a number."""


@dataclass
class Reward:
    name: str  # how its metrics are logged: rewards/<name>/mean, rewards/<name>/std
    fn: Callable[..., float]
    weight: float = 1.0


def regex_reward(pattern: str) -> Callable[..., float]:
    rx = re.compile(pattern, re.DOTALL)

    def reward(prompt, completion, **row):
        return 1.0 if rx.fullmatch(completion.strip()) else 0.0

    return reward


def exact_reward(column: str, pattern: str = "") -> Callable[..., float]:
    rx = re.compile(pattern, re.DOTALL) if pattern else None

    def reward(prompt, completion, **row):
        if column not in row:
            raise RewardError(f"the exact-match reward reads column {column!r}, which the row does not have")
        text = completion.strip()
        if rx is not None:
            m = rx.search(text)
            if m is None:
                return 0.0
            text = (m.group(1) if rx.groups else m.group(0)).strip()
        return 1.0 if text == str(row[column]).strip() else 0.0

    return reward


def length_reward(max_chars: int) -> Callable[..., float]:
    def reward(prompt, completion, **row):
        return -max(0, len(completion) - max_chars) / max_chars

    return reward


def load_user_reward(path: str | Path) -> Callable[..., float]:
    """The `reward` function of the user's Python file (executing the file)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise RewardError(f"{path}: no such reward file")
    spec = importlib.util.spec_from_file_location(f"tunesmith_reward_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: any error, reported with the file
        raise RewardError(f"{path}: loading the reward file failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, "reward", None)
    if not callable(fn):
        raise RewardError(f"{path}: defines no function `reward(prompt, completion, **row) -> float`")
    return fn


def build_rewards(configs) -> list[Reward]:
    """Reward objects from grpo.rewards (engine.config.RewardConfig); names made unique."""
    out: list[Reward] = []
    for i, c in enumerate(configs):
        if c.kind == "regex":
            fn, name = regex_reward(c.pattern), "format"
        elif c.kind == "exact":
            fn, name = exact_reward(c.column, c.pattern), f"exact_{c.column}"
        elif c.kind == "length":
            fn, name = length_reward(c.max_chars), "length"
        elif c.kind == "python":
            fn, name = load_user_reward(c.file), Path(c.file).stem
        else:
            raise RewardError(f"grpo.rewards[{i}].kind: unknown reward kind {c.kind!r}")
        if any(r.name == name for r in out):
            name = f"{name}_{i}"
        out.append(Reward(name, fn, c.weight))
    if not out:
        raise RewardError("grpo.rewards: GRPO needs at least one reward function")
    return out


def score(rewards: list[Reward], prompts, completions, rows, row_ids, where: str = "") -> list[list[float]]:
    """[completion][reward] values; a failure names the reward and the data row (`row_ids`)."""
    table = []
    for prompt, completion, row, row_id in zip(prompts, completions, rows, row_ids):
        values = []
        for r in rewards:
            try:
                v = float(r.fn(prompt, completion, **row))
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(
                    f"reward {r.name!r} failed on {where}row {shown_row(row_id)}: {type(exc).__name__}: {exc}"
                ) from exc
            if not math.isfinite(v):
                raise RewardError(f"reward {r.name!r} returned {v} on {where}row {shown_row(row_id)}")
            values.append(v)
        table.append(values)
    return table
