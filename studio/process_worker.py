"""A run on several GPUs, started from the window: `tunesmith train --gpus N` as a child process.

Single-GPU runs stay in-process (studio.worker.TrainingWorker); a multi-process run cannot, since
torchrun owns its ranks. `ProcessWorker` has the same face as TrainingWorker (signals `event` and
`finished`; start, pause, resume, stop, is_running, wait), so the window drives both alike:

- the child is ``python -m engine train CONFIG --output RUN --gpus N --events-json``; rank 0
  prints every engine event as one JSON line on stdout, which becomes the same typed event a
  local run emits (other lines of torchrun's go to the log);
- pause, resume and stop are written to the run folder's control file, which rank 0 reads
  between steps and all ranks agree on (engine.train.distributed);
- a child that ends without the run's outcome (a rank died, torchrun failed) becomes one Failed
  event with its last error line; the CLI has already stopped every rank, and the checkpoints
  are intact.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from engine import api


class ProcessWorker(QObject):
    event = Signal(object)
    finished = Signal()

    def __init__(self, config, nproc: int, run_dir: Optional[str] = None, resume_from: Optional[str] = None):
        super().__init__()
        self._config = config
        self.nproc = int(nproc)
        self._resume_from = resume_from
        if resume_from:
            self.run_dir = Path(api.run_folder_of(resume_from))
        else:
            out = config.output
            folder = api.RunFolder(run_dir) if run_dir else api.new_run_folder(out.dir, out.run_name, out.overwrite)[0]
            self.run_dir = folder.path
        self._tmp = Path(tempfile.mkdtemp(prefix="tunesmith-run-"))
        self._buffer = b""
        self._stderr: deque[str] = deque(maxlen=40)
        self._outcome_seen = False
        self._early: Optional[str] = None  # a pause/stop asked for before rank 0 made the folder
        self.proc = QProcess(self)
        self.proc.readyReadStandardOutput.connect(self._read_stdout)
        self.proc.readyReadStandardError.connect(self._read_stderr)
        self.proc.finished.connect(self._done)
        self.proc.errorOccurred.connect(self._error)

    # -- the face TrainingWorker has ----------------------------------------------------------
    def start(self) -> None:
        cfg = self._tmp / "config.yaml"
        self._config.save(cfg)
        args = ["-m", "engine", "train", str(cfg), "--gpus", str(self.nproc), "--events-json"]
        args += ["--resume", str(self._resume_from)] if self._resume_from else ["--output", str(self.run_dir)]
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        # The engine as this window sees it, also when it runs from a checkout.
        env.insert("PYTHONPATH", os.pathsep.join(p for p in [_project_root(), env.value("PYTHONPATH")] if p))
        self.proc.setProcessEnvironment(env)
        self._control("resume")  # a stale request from an earlier run of this folder is gone
        self.proc.start(sys.executable, args)

    def pause(self) -> None:
        self._control("pause")

    def resume(self) -> None:
        self._control("resume")

    def stop(self) -> None:
        self._control("stop")

    def is_running(self) -> bool:
        return self.proc.state() != QProcess.ProcessState.NotRunning

    def wait(self, ms: int = -1) -> bool:
        if not self.is_running():
            return True
        return self.proc.waitForFinished(ms)

    # -- plumbing -------------------------------------------------------------------------------
    def _control(self, request: str) -> None:
        """Atomically replace the run's control file (rank 0 reads it between steps)."""
        if not self.run_dir.exists():
            if request != "resume":
                self._early = request  # before rank 0 made the folder: written when it exists
            return
        try:
            api.RunFolder(self.run_dir).write_control(request)
        except OSError:
            pass

    def _read_stdout(self) -> None:
        self._buffer += bytes(self.proc.readAllStandardOutput())
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                event = api.event_from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError):
                event = api.LogLine(line, "info")  # torchrun's own lines
            if isinstance(event, (api.Finished, api.Failed)):
                self._outcome_seen = True
            if isinstance(event, api.RunStarted):
                self.run_dir = Path(event.run_dir)
                if self._early:
                    early, self._early = self._early, None
                    self._control(early)
            self.event.emit(event)

    def _read_stderr(self) -> None:
        text = bytes(self.proc.readAllStandardError()).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.strip():
                self._stderr.append(line.rstrip())

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self.event.emit(api.Failed(f"Could not start the training processes: {self.proc.errorString()}"))
            self._outcome_seen = True
            self.finished.emit()

    def _done(self, code: int, _status) -> None:
        self._read_stdout()
        self._read_stderr()
        if not self._outcome_seen:
            errors = [ln for ln in self._stderr if ln.startswith("error:")] or list(self._stderr)[-1:]
            message = errors[-1].removeprefix("error: ") if errors else f"the processes ended with status {code}"
            last = None
            try:
                ckpt = api.RunFolder(self.run_dir).latest_checkpoint()
                last = str(ckpt) if ckpt else None
            except Exception:
                pass
            self.event.emit(
                api.Failed(f"The run on {self.nproc} GPUs stopped: {message}", "\n".join(self._stderr), last)
            )
        self.finished.emit()


def _project_root() -> str:
    return str(Path(__file__).resolve().parent.parent)
