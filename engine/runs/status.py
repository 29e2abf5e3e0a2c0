"""A run's status and whether it can resume: the one status rule (`status_of`), what a window
shows for it (`shown_status`), the one resume decision (`resume_refusal`, which RunFolder,
RunInfo and the Runs page's RunSummary all use), and RunInfo: what a run holds (its adapter,
checkpoints, best checkpoint) and what can be exported or chatted with. Cheap: the last line of
metrics.jsonl, the listing and best.json, never the whole history (that is engine.runs.history)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from engine.runs.layout import RunLayout
from engine.runs.records import last_event, lock_is_live, read_best

# A run whose metrics.jsonl or log.txt changed this recently is being written to (a writer
# mid-line, a run in another process).
RUNNING_WINDOW_S = 300.0


def status_of(outcome: Optional[dict], running: bool = False, problem: str = "") -> str:
    """A run's status from its last outcome event (the last Finished / Failed line of
    metrics.jsonl, None without one): "finished", "stopped", "failed"; without an outcome
    "running" while a process trains it, else "incomplete"; "corrupt" when `problem` names a
    file that cannot be read. The one rule: RunFolder.status() and the summary both use it."""
    outcome = outcome or {}
    if problem:
        return "corrupt"
    if outcome.get("event") == "Finished":
        return "stopped" if outcome.get("stopped") else "finished"
    if outcome.get("event") == "Failed":
        return "failed"
    return "running" if running else "incomplete"


def shown_status(status: str, ours: bool = False, busy: bool = False) -> str:
    """What a window shows for a run whose files say `status` (status_of's word): "running" for
    the run it is training now (`ours`: until the new RunStarted lands, a resumed run's files end
    with the earlier session's outcome), and for an incomplete run that something is still writing
    (`busy`); `status` otherwise."""
    if ours or (busy and status == "incomplete"):
        return "running"
    return status


def resume_refusal(name: str, status: str, has_checkpoint: bool) -> str:
    """Why a run with `status` cannot be resumed, one sentence ("" when it can): a stopped,
    failed or interrupted run with a checkpoint to continue from can. The one decision."""
    if status == "running":
        return f"{name} is running."
    if status == "finished":
        return f"{name} finished: there is nothing left to train."
    if status == "corrupt":
        return f"{name} has files that cannot be read."
    if not has_checkpoint:
        return f"{name} has no checkpoint to resume from."
    return ""


def folder_status(run: RunLayout) -> str:
    """From the last line of metrics.jsonl alone (cheap): "running" is the summary's, which
    also looks at the lock."""
    return status_of(last_event(run))


def why_not_resumable(run: RunLayout, ours: bool = False) -> str:
    """Why the run in this folder cannot be resumed, one sentence ("" when it can). Cheap: the
    last line of metrics.jsonl, the lock and the checkpoints folder, never the whole history.
    `ours`: the caller is training this run now (before its lock is written, or in a child process)."""
    if not run.is_run():
        return f"{run.path} is not a run folder (it has no config.yaml)."
    status = "running" if ours or lock_is_live(run) else folder_status(run)
    return resume_refusal(run.path.name, status, run.latest_checkpoint() is not None)


def best_label(eval_loss: float, step: int) -> str:
    """How Chat and Export name the best checkpoint."""
    return f"best (eval loss {eval_loss:.4f} at step {step})"


@dataclass
class RunInfo:
    path: Path
    adapter: Optional[Path]  # final adapter/ of a finished run
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)  # (step, folder), ascending
    status: str = ""  # "finished", "stopped", "failed", "incomplete" from the last event
    best: Optional[dict] = None  # best.json: {step, eval_loss, checkpoint}

    @property
    def name(self) -> str:
        return self.path.name

    def best_checkpoint(self) -> Optional[tuple[int, Path, float]]:
        """(step, folder, eval loss) of the best checkpoint by eval loss, when it still exists."""
        best = self.best or {}
        step, loss = best.get("step"), best.get("eval_loss")
        if not isinstance(step, int) or not isinstance(loss, (int, float)):
            return None
        for s, p in self.checkpoints:
            if s == step:
                return s, p, float(loss)
        return None

    def sources(self) -> list[tuple[str, Path]]:
        """What can be exported or chatted with: the best checkpoint by eval loss first (when
        the run measured one), then the final adapter, then the checkpoints, newest first."""
        out = []
        best = self.best_checkpoint()
        if best is not None:
            out.append((best_label(best[2], best[0]), best[1]))
        if self.adapter is not None:
            out.append(("final adapter", self.path))
        out += [(f"checkpoint step {s}", p) for s, p in reversed(self.checkpoints) if best is None or s != best[0]]
        return out

    def why_not_resumable(self, ours: bool = False) -> str:
        """Why this run cannot be resumed, one sentence ("" when it can): `resume_refusal`.
        `ours`: the caller is training this run now, whatever its files say."""
        return resume_refusal(self.name, "running" if ours else self.status, bool(self.checkpoints))

    @property
    def resumable(self) -> bool:
        """A stopped, failed or interrupted run with a checkpoint to continue from."""
        return not self.why_not_resumable()


def info_of(run: RunLayout) -> RunInfo:
    return RunInfo(
        path=run.path,
        adapter=run.final_adapter(),
        checkpoints=run.checkpoints(),
        status=folder_status(run),
        best=read_best(run),
    )


def read_run(path: str | Path) -> Optional[RunInfo]:
    run = RunLayout(path)
    return info_of(run) if run.is_run() else None


def list_runs(root: str | Path) -> list[RunInfo]:
    """RunInfo of every run folder directly under `root`, newest first."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    runs = [r for r in (read_run(p) for p in root.iterdir() if p.is_dir()) if r is not None]
    runs.sort(key=lambda r: r.path.stat().st_mtime, reverse=True)
    return runs
