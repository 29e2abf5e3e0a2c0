"""The one place that knows a run folder: its layout, its status and history, and the checks
before a run is written. Plain files only: no torch, no Qt; a leaf of the engine (it imports no
other engine module: pyproject.toml's import-linter contracts).

A run folder::

    <run>/
      config.yaml              the RunConfig the run used (its presence makes a folder a run)
      metrics.jsonl            every event, one JSON object a line; the last line is the outcome
      log.txt                  the log lines, "HH:MM:SS level: message"
      checkpoints/step-N/      a complete checkpoint (written as step-N.tmp, then renamed)
        adapter/               a standard PEFT adapter (+ tokenizer files)
        optimizer.pt scheduler.pt rng.pt trainer_state.json
      adapter/                 the final adapter of a finished run (written as adapter.tmp)
      exports/<kind>.json      the report an export wrote about itself (kind: "adapter", "merged", ...)
      export-report.json       the self-check's verdict of each kind's last export: {"exports": {kind: verdict}}
      best.json                the checkpoint of the best eval loss so far: {step, eval_loss, checkpoint}
      gallery.jsonl            the gallery's answers at each checkpoint: {step, prompt, answer} a line
      running.lock             {pid, host, started} while a process trains the run (removed at its end)
      control                  the window's request to a run under torchrun (pause, resume, stop)
      tensorboard/             TensorBoard scalars (output.tensorboard)

The modules, each importing only those above it:
  layout.py   the file names (CONFIG, METRICS, LOG, CHECKPOINTS, ADAPTER, EXPORTS, STATE_FILE,
              OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, ADAPTER_CONFIG, ADAPTER_WEIGHTS and
              ADAPTER_FILES (PEFT's), TMP_SUFFIX, BEST, GALLERY, LOCK, TENSORBOARD, CONTROL,
              EXPORT_VERDICTS); RunLayout, the paths of one run folder
              and what its listing says (checkpoints, latest_checkpoint, final_adapter, partials);
              step_of, tmp_for, is_adapter, run_folder_of, resume_checkpoint, adapter_in, config_for;
              failure_log (a failure's traceback beside the runs); RunFolderError. Nothing outside
              engine.runs spells a file name of a run folder.
  publish.py  publish(tmp, final): a folder written as ".tmp" put in place with one rename
  records.py  the small files read and written whole: metrics.jsonl's last line, config.yaml,
              best.json, gallery.jsonl, running.lock (a lock naming a live process), control
  status.py   the one status rule (status_of), what a window shows (shown_status), the one resume
              decision (resume_refusal), RunInfo (its sources: the best checkpoint first), read_run,
              list_runs, best_label, RUNNING_WINDOW_S
  checks.py   run_name_problem (the one rule for a run's name), write_problem (permissions, free
              disk: MIN_FREE_BYTES, read there), check_free / check_writable
  history.py  the Runs page: RunHistory (curves from metrics.jsonl), RunSummary (a RunInfo with the
              history's figures), summarize_runs, config_differences, CURVES, EVAL_CURVES
  folder.py   RunFolder: a RunLayout with every question above as a method (status, info,
              why_not_resumable, best, gallery, lock, history, summary, rename, delete, check_free,
              create...), and new_run_folder, the one rule for a new run's folder

Callers import these names from engine.runs itself; the studio gets them through engine.api.
"""

from __future__ import annotations

from engine.runs.checks import MIN_FREE_BYTES, run_name_problem, write_problem
from engine.runs.folder import RunFolder, new_run_folder
from engine.runs.history import CURVES, EVAL_CURVES, RunHistory, RunSummary, config_differences, summarize_runs
from engine.runs.layout import (
    ADAPTER,
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    ADAPTER_WEIGHTS,
    BEST,
    CHECKPOINTS,
    CONFIG,
    CONTROL,
    EXPORT_VERDICTS,
    EXPORTS,
    GALLERY,
    LOCK,
    LOG,
    METRICS,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    TENSORBOARD,
    TMP_SUFFIX,
    RunFolderError,
    adapter_in,
    config_for,
    failure_log,
    is_adapter,
    resume_checkpoint,
    run_folder_of,
    step_of,
    tmp_for,
)
from engine.runs.publish import publish
from engine.runs.status import (
    RUNNING_WINDOW_S,
    RunInfo,
    best_label,
    list_runs,
    read_run,
    resume_refusal,
    shown_status,
    status_of,
)

__all__ = [
    "ADAPTER",
    "ADAPTER_CONFIG",
    "ADAPTER_FILES",
    "ADAPTER_WEIGHTS",
    "BEST",
    "CHECKPOINTS",
    "CONFIG",
    "CONTROL",
    "CURVES",
    "EVAL_CURVES",
    "EXPORTS",
    "EXPORT_VERDICTS",
    "GALLERY",
    "LOCK",
    "LOG",
    "METRICS",
    "MIN_FREE_BYTES",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "RUNNING_WINDOW_S",
    "SCHEDULER_FILE",
    "STATE_FILE",
    "TENSORBOARD",
    "TMP_SUFFIX",
    "RunFolder",
    "RunFolderError",
    "RunHistory",
    "RunInfo",
    "RunSummary",
    "adapter_in",
    "best_label",
    "config_differences",
    "config_for",
    "failure_log",
    "is_adapter",
    "list_runs",
    "new_run_folder",
    "publish",
    "read_run",
    "resume_checkpoint",
    "resume_refusal",
    "run_folder_of",
    "run_name_problem",
    "shown_status",
    "status_of",
    "step_of",
    "summarize_runs",
    "tmp_for",
    "write_problem",
]
