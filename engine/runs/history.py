"""A run's history read back from its folder (the Runs page): per-step curves from
metrics.jsonl (`read_history` -> RunHistory), one row of the run list (`summarize` ->
RunSummary: a RunInfo with the history's figures, whose status is engine.runs.status' one rule
and whose `resumable` its one decision), every run under a folder (`summarize_runs`) and what
differs between runs' configs (`config_differences`). Never raises for a broken folder: it names
the problem instead. Reads each metrics.jsonl whole, where engine.runs.status reads its last line.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from engine.runs.layout import METRICS, TMP_SUFFIX, RunLayout
from engine.runs.records import last_write, lock_is_live, read_best, read_config
from engine.runs.status import RUNNING_WINDOW_S, RunInfo, status_of

# What a run's history keeps of each StepMetrics line (the Runs page's charts).
CURVES = ("loss", "lr", "grad_norm", "tokens_per_second", "step_seconds", "mem_peak")
# And of each EvalMetrics line: NaN at the steps without an eval.
EVAL_CURVES = ("eval_loss",)
# Keys that differ between any two runs without saying anything about how they trained.
_NOT_A_DIFFERENCE = ("output.run_name", "auto_fields", "auto_reasons")


@dataclass
class RunHistory:
    """Per-step curves read back from metrics.jsonl. A step logged twice (a run resumed from a
    checkpoint before its last logged step) keeps its latest value: that is the run's weights."""

    steps: list[int] = field(default_factory=list)  # ascending
    curves: dict[str, list[float]] = field(default_factory=dict)  # CURVES name -> value per step
    total_steps: int = 0
    started: Optional[float] = None  # time of the first event
    seconds: float = 0.0  # training time: each session's first to last event, summed
    outcome: Optional[dict] = None  # the last Finished / Failed event, None while there is none
    problems: list[str] = field(default_factory=list)  # one sentence each, naming file and line

    def curve(self, name: str) -> tuple[list[int], list[float]]:
        return self.steps, self.curves.get(name, [])


@dataclass
class RunSummary(RunInfo):
    """One row of the run list: a RunInfo (path, adapter, checkpoints, status, best; its
    sources and its resume decision) with what the history says. `status`: "running", "finished",
    "stopped", "failed", "incomplete" (no outcome and no longer written to) or "corrupt" (see
    `problem`)."""

    problem: str = ""  # why the status is "corrupt", one sentence naming the file
    started: Optional[float] = None  # epoch seconds
    model: str = ""
    data: str = ""
    steps: int = 0  # the last step logged
    total_steps: int = 0
    final_loss: Optional[float] = None
    best_loss: Optional[float] = None
    best_step: Optional[int] = None
    seconds: float = 0.0
    tokens_per_second: Optional[float] = None  # median over the steps
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml as plain data ({} unreadable)


def read_history(folder: RunLayout, now: Optional[float] = None) -> RunHistory:
    """Read metrics.jsonl back. Unreadable lines are skipped and named in `problems`, except
    an unfinished last line of a run still being written (the writer is mid-line)."""
    hist = RunHistory(curves={name: [] for name in CURVES + EVAL_CURVES})
    try:
        raw = folder.metrics.read_bytes()
    except FileNotFoundError:
        hist.problems.append(f"{METRICS} is missing from {folder.path}")
        return hist
    except OSError as exc:
        hist.problems.append(f"{folder.metrics} cannot be read: {exc.strerror or exc}")
        return hist
    now = time.time() if now is None else now
    written = last_write(folder) or 0.0
    lines = raw.split(b"\n")
    by_step: dict[int, dict[str, float]] = {}
    evals: dict[int, dict[str, float]] = {}
    segment: list[float] = []  # first and last event time of the session being read
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        unfinished = number == len(lines)  # no newline after it
        event = _parse_event(line)
        if isinstance(event, str):
            if unfinished and now - written < RUNNING_WINDOW_S:
                continue
            hist.problems.append(f"{folder.metrics.name} line {number} {event}")
            continue
        t = event.get("time")
        if isinstance(t, (int, float)):
            hist.started = t if hist.started is None else hist.started
            segment = [segment[0] if segment else t, t]
        kind = event.get("event")
        if kind == "RunStarted":
            hist.total_steps = _int(event.get("total_steps"), hist.total_steps)
            hist.outcome = None  # a resumed run: the earlier outcome is no longer the last word
        elif kind == "StepMetrics":
            step, loss = event.get("step"), event.get("loss")
            if not isinstance(step, int) or not isinstance(loss, (int, float)):
                hist.problems.append(f"{folder.metrics.name} line {number} is a step without a step number or loss")
                continue
            by_step[step] = {name: _float(event.get(name)) for name in CURVES}
            # The method's own metrics (reward margins, accuracy, mean reward, KL...): the Runs
            # overlay compares runs of any method on what they logged.
            extra = event.get("metrics")
            if isinstance(extra, dict):
                by_step[step].update({k: _float(v) for k, v in extra.items() if k not in by_step[step]})
            hist.total_steps = _int(event.get("total_steps"), hist.total_steps)
        elif kind == "EvalMetrics" and isinstance(event.get("step"), int):
            evals[event["step"]] = {name: _float(event.get(name)) for name in EVAL_CURVES}
        elif kind in ("Finished", "Failed"):
            hist.outcome = event
            if len(segment) == 2:
                hist.seconds += segment[1] - segment[0]
            segment = []
    if len(segment) == 2:  # a session without an outcome (running, or it ended abruptly)
        hist.seconds += segment[1] - segment[0]
    hist.steps = sorted(by_step)
    logged = dict.fromkeys(k for s in hist.steps for k in by_step[s])  # CURVES first, then the method's
    for name in logged:
        hist.curves[name] = [by_step[s].get(name, math.nan) for s in hist.steps]
    nan = {name: math.nan for name in EVAL_CURVES}
    for name in EVAL_CURVES:
        hist.curves[name] = [evals.get(s, nan)[name] for s in hist.steps]
    return hist


def summarize(folder: RunLayout, now: Optional[float] = None) -> RunSummary:
    """One row of the run list; never raises for a broken folder (status "corrupt", `problem`)."""
    now = time.time() if now is None else now
    config, config_problem = read_config(folder)
    hist = read_history(folder, now)
    problem = config_problem or (hist.problems[0] if hist.problems else "")
    if len(hist.problems) > 1:
        problem += f" (and {len(hist.problems) - 1} more unreadable lines)"
    outcome = hist.outcome or {}
    status = status_of(hist.outcome, not problem and not outcome and lock_is_live(folder), problem)
    losses = [(v, s) for s, v in zip(hist.steps, hist.curves["loss"]) if math.isfinite(v)]
    best = min(losses) if losses else None
    speeds = [v for v in hist.curves["tokens_per_second"] if math.isfinite(v) and v > 0]
    started = hist.started
    if started is None:
        try:
            started = folder.path.stat().st_mtime
        except OSError:
            started = None
    sections = {k: v for k, v in config.items() if isinstance(v, dict)}
    return RunSummary(
        path=folder.path,
        status=status,
        problem=problem,
        started=started,
        model=str((sections.get("model") or {}).get("name_or_path") or ""),
        data=str((sections.get("data") or {}).get("source") or ""),
        steps=hist.steps[-1] if hist.steps else 0,
        total_steps=hist.total_steps,
        final_loss=hist.curves["loss"][-1] if hist.steps else None,
        best_loss=best[0] if best else None,
        best_step=best[1] if best else None,
        seconds=hist.seconds,
        tokens_per_second=statistics.median(speeds) if speeds else None,
        checkpoints=folder.checkpoints(),
        adapter=folder.final_adapter(),
        config=config,
        best=read_best(folder),
    )


def _parse_event(line: bytes) -> dict | str:
    """A metrics line as a dict, or what is wrong with it (the end of a sentence)."""
    try:
        event = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    except ValueError:
        return "is not valid JSON"
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return 'is not an event (no "event" field)'
    return event


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def summarize_runs(root: str | Path, now: Optional[float] = None) -> list[RunSummary]:
    """A RunSummary of every run-like folder directly under `root`, newest first. Reads each
    metrics.jsonl whole: call it off the GUI thread."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    found = []
    for p in root.iterdir():
        if p.is_dir() and not p.name.endswith(TMP_SUFFIX) and RunLayout(p).looks_like_run():
            found.append(summarize(RunLayout(p), now))
    found.sort(key=lambda r: (r.started or 0.0, r.name), reverse=True)
    return found


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and key != "columns":  # a column mapping is one value
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def config_differences(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """[(dotted key, [its value in each config])] for every key whose values are not all equal
    (None where a config lacks the key), in the order the keys first appear. The run name and
    the policy's bookkeeping (auto_fields, auto_reasons) are left out: they say nothing about
    how a run trained."""
    flat = [_flatten(c or {}) for c in configs]
    keys: dict[str, None] = {}
    for f in flat:
        keys.update(dict.fromkeys(f))
    out = []
    for key in keys:
        if key.startswith(_NOT_A_DIFFERENCE):
            continue
        values = [f.get(key) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out.append((key, values))
    return out
