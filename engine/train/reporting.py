"""Where a run's events go: the caller's callback, the run folder's metrics.jsonl and log.txt,
and TensorBoard / W&B when the config asks for them. Rank 0 reports for a run in several
processes; the others' reporter says nothing.

Also the once-per-run notes about fast paths that did not run (engine.counters' fallbacks).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Callable, Optional

from engine.counters import requested_but_not_run
from engine.data import plural
from engine.events import Event, LogLine


class Reporter:
    def __init__(self, on_event: Optional[Callable[[Event], None]], is_main: bool = True):
        self.on_event = on_event
        self.is_main = is_main
        self._metrics_file = None
        self._log_file = None
        self.loggers = None  # engine.train.loggers.Loggers, when opened
        self._said: set = set()  # fallbacks and missing fast paths already logged (once each)

    def open_files(self, folder) -> None:
        """Append the events to the run folder's metrics.jsonl and the log lines to log.txt."""
        self._metrics_file = open(folder.metrics, "a", encoding="utf-8")
        self._log_file = open(folder.log, "a", encoding="utf-8")

    def open_loggers(self, output, folder, config: dict) -> None:
        """TensorBoard / W&B when `output` asks for them (rank 0; never a reason to fail)."""
        if not self.is_main or not (output.tensorboard or output.wandb):
            return
        from engine.train.loggers import Loggers

        self.loggers = Loggers.open(output, folder.path, config, self.log)

    def emit(self, event: Event) -> None:
        if not self.is_main:
            return  # rank 0 reports for the run
        if self._metrics_file is not None:
            _append(self._metrics_file, json.dumps(event.to_dict(), default=str) + "\n")
        if isinstance(event, LogLine) and self._log_file is not None:
            stamp = datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
            _append(self._log_file, f"{stamp} {event.level}: {event.message}\n")
        if self.on_event is not None:
            self.on_event(event)

    def log(self, message: str, level: str = "info") -> None:
        self.emit(LogLine(message, level))

    def close(self) -> None:
        for f in (self._metrics_file, self._log_file):
            if f is not None:
                f.close()
        self._metrics_file = self._log_file = None
        if self.loggers is not None:
            self.loggers.close()
            self.loggers = None

    def say_what_did_not_run(self, fast: dict, calls: dict, fallbacks: dict, device: str, step: int) -> None:
        """Log each distinct fallback reason and each requested fast path that did not run (or
        ran on some layers only) once per run: a warning on a GPU, where it costs speed or
        memory; a note elsewhere."""
        level = "warning" if device.startswith("cuda") else "info"
        said = self._said
        for entry, n in fallbacks.items():
            if ("fallback", entry) not in said:
                said.add(("fallback", entry))
                self.log(f"Fast path fallback in step {step}: {entry} ({plural(n, 'call')} took the stock path)", level)
        for path, what in requested_but_not_run(fast, calls, fallbacks, device).items():
            key = ("missing", path, what.split(":")[0].split(";")[0])
            if key not in said:
                said.add(key)
                self.log(f"Fast path {path} was requested ({fast.get(path)}) but in step {step} {what}", level)


def _append(f, text: str) -> None:
    """One line into the run's metrics or log file. On a full disk the line is dropped (the
    event still reaches on_event, and the checkpoint guard says the disk is full) rather than
    ending the run over its log."""
    from engine.train.checkpoint import is_disk_full

    try:
        f.write(text)
        f.flush()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
