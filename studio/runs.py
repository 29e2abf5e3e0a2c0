"""Finding run folders on disk (config.yaml, metrics.jsonl, checkpoints/step-N/, adapter/)
for the Export and Chat pages. Plain files only: no engine internals, no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class RunInfo:
    path: Path
    adapter: Optional[Path]  # final adapter/ of a finished run
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)  # (step, folder), ascending
    status: str = ""  # "finished", "stopped", "failed", "running?" from the last event

    @property
    def name(self) -> str:
        return self.path.name

    def sources(self) -> list[tuple[str, Path]]:
        """What can be exported or chatted with: the final adapter, then checkpoints, newest first."""
        out = []
        if self.adapter is not None:
            out.append(("final adapter", self.path))
        out += [(f"checkpoint step {s}", p) for s, p in reversed(self.checkpoints)]
        return out


def _last_event(metrics: Path) -> Optional[dict]:
    try:
        with metrics.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))  # the tail is enough: the last line is the outcome
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError, IndexError):
        return None


def read_run(path: Path) -> Optional[RunInfo]:
    if not (path / "config.yaml").is_file():
        return None
    adapter = path / "adapter"
    ckpts = []
    cdir = path / "checkpoints"
    if cdir.is_dir():
        for c in cdir.iterdir():
            if c.is_dir() and c.name.startswith("step-"):
                try:
                    ckpts.append((int(c.name.split("-", 1)[1]), c))
                except ValueError:
                    continue
    ckpts.sort()
    last = _last_event(path / "metrics.jsonl") or {}
    kind = last.get("event", "")
    status = {"Finished": "stopped" if last.get("stopped") else "finished", "Failed": "failed"}.get(kind, "incomplete")
    return RunInfo(path=path, adapter=adapter if (adapter / "adapter_config.json").is_file() else None,
                   checkpoints=ckpts, status=status)


def list_runs(runs_dir: str | Path) -> list[RunInfo]:
    root = Path(runs_dir).expanduser()
    if not root.is_dir():
        return []
    runs = [r for r in (read_run(p) for p in root.iterdir() if p.is_dir()) if r is not None]
    runs.sort(key=lambda r: r.path.stat().st_mtime, reverse=True)
    return runs
