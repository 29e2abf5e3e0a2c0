"""The studio's main window: a step list on the left (Model → Data → Train → Monitor → Chat →
Export, plus Runs and Hardware) and one page per step on the right.

The window owns the shared state and the training worker, and routes engine events to the
pages. It imports no torch: heavy work starts from `start_background()` after the window is
on screen, on pool threads.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable, Optional

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QStackedWidget,
    QWidget,
)

from engine import api
from engine.api import ConfigError
from studio.panels.chat import ChatPanel
from studio.panels.dataset import DataPanel
from studio.panels.export import ExportPanel
from studio.panels.hardware import HardwarePanel
from studio.panels.model import ModelPanel
from studio.panels.monitor import MonitorPanel, one_sentence
from studio.panels.runs import METHOD_LABELS, RunsPanel
from studio.panels.training import TrainingPanel
from studio.process_worker import ProcessWorker
from studio.settings import Settings
from studio.state import StudioState, model_problems
from studio.tasks import run_task
from studio.widgets.step_list import StepList
from studio.worker import TrainingWorker

MODEL, DATA, TRAIN, MONITOR, CHAT, EXPORT, RUNS, HARDWARE = range(8)
STEPS = [
    ("Model", "Pick the base model"),
    ("Data", "Load and inspect the examples"),
    ("Train", "Hyperparameters and presets"),
    ("Monitor", "Watch the run"),
    ("Chat", "Talk to the result"),
    ("Export", "Write the adapter or a merged model"),
]


def _detect_hardware():
    from engine.api import detect

    return detect()


def _warm_engine() -> float:
    """Import what a training run needs, on a pool thread, while the person is still choosing.

    Importing torch, transformers, peft and datasets holds the GIL for stretches of hundreds of
    milliseconds; done here, it never happens on the worker thread during a run, where it
    would freeze the window (the event loop stays under 50 ms during a run because of this).
    """
    from studio.warmup import ensure_warm

    return ensure_warm()


def _step_list() -> StepList:
    """The guided steps, then Runs and Hardware below a separator."""
    steps = StepList()
    for name, tip in STEPS:
        steps.add_step(name, tip)
    steps.add_step("Runs", "Every run: compare, resume, rename, delete", separated=True)
    steps.add_step("Hardware", "What the engine detected")
    return steps


class MainWindow(QMainWindow):
    run_finished = Signal(object)  # the Finished or Failed event that ended a run
    warmed_up = Signal(float)  # the engine's heavy imports are done (seconds they took)

    def __init__(self, settings: Optional[Settings] = None, runs_dir: Optional[str] = None):
        super().__init__()
        self.setWindowTitle("Tunesmith Studio")
        self.settings = settings or Settings()
        self.state = StudioState(runs_dir or self.settings.runs_dir(), self)
        self.worker: Optional[TrainingWorker] = None
        self.finished_event = None
        self.engine_warm = False
        self.train_action: Optional[QAction] = None
        self.resume_action: Optional[QAction] = None
        self._run_started_at = 0.0
        self._run_dir_now: Optional[str] = None  # the folder of the run in progress, once known
        self._close_after_stop = False
        # Asked before closing during a run; tests replace it to answer without a dialog.
        self.confirm: Callable[[str, str], bool] = self._ask

        self.steps = _step_list()
        self._build_pages()
        self._build_central()
        self._build_menu()
        self._wire()
        self.update_train_gate()
        # Ready to Train on the demo: its preset's hyperparameters suit the bundled tiny model.
        self.training_panel.apply_preset("demo", quiet=True)
        self.steps.select_step(MODEL)
        self.sync_run_menu()
        self._restore_geometry()

    # -- construction -----------------------------------------------------------------------
    def _build_pages(self) -> None:
        """One panel per step, in the step list's order, on a stack."""
        self.model_panel = ModelPanel(self.state, self.settings)
        self.data_panel = DataPanel(self.state, self.settings)
        self.training_panel = TrainingPanel(self.state, self.settings)
        self.monitor_panel = MonitorPanel()
        self.chat_panel = ChatPanel(self.state)
        self.export_panel = ExportPanel(self.state)
        self.runs_panel = RunsPanel(self.state)
        self.hardware_panel = HardwarePanel(self.state)
        self.pages = QStackedWidget()
        for page in (
            self.model_panel,
            self.data_panel,
            self.training_panel,
            self.monitor_panel,
            self.chat_panel,
            self.export_panel,
            self.runs_panel,
            self.hardware_panel,
        ):
            page.setObjectName("page")
            self.pages.addWidget(page)

    def _build_central(self) -> None:
        """The step list beside the pages, and the status bar's hardware line."""
        central = QWidget()
        lay = QHBoxLayout(central)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(self.steps)
        lay.addWidget(self.pages, 1)
        self.setCentralWidget(central)
        self.device_label = QLabel("Detecting hardware…")
        self.statusBar().addPermanentWidget(self.device_label)

    def _restore_geometry(self) -> None:
        """The size and layout the window had when it was last closed, within the screen."""
        self.resize(1200, 800)
        geometry = self.settings.geometry()
        if geometry is not None:
            self.restoreGeometry(geometry)
        win_state = self.settings.window_state()
        if win_state is not None:
            self.restoreState(win_state)
        # A size saved when something had widened the window must not reopen it past the screen.
        screen = self.screen().availableGeometry() if self.screen() is not None else None
        if screen is not None and (self.width() > screen.width() or self.height() > screen.height()):
            self.resize(min(self.width(), screen.width()), min(self.height(), screen.height()))

    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        for text, slot, key in (
            ("Open config…", self.training_panel._load_dialog, QKeySequence.StandardKey.Open),
            ("Save config…", self.training_panel._save_dialog, QKeySequence.StandardKey.Save),
            ("Quit", self.close, QKeySequence.StandardKey.Quit),
        ):
            action = QAction(text, self)
            action.setShortcut(key)
            action.triggered.connect(slot)
            file_menu.addAction(action)
        run_menu = self.menuBar().addMenu("&Run")
        run_menu.aboutToShow.connect(self.sync_run_menu)
        self.run_actions: dict[str, QAction] = {}
        for text, slot in (
            ("Train", self.start_training),
            ("Pause", self.pause),
            ("Resume", self.resume),
            ("Stop", self.stop),
        ):
            action = QAction(text, self)
            action.triggered.connect(slot)
            run_menu.addAction(action)
            self.run_actions[text] = action
            if text == "Train":
                self.train_action = action
            elif text == "Resume":
                action.setToolTip("Un-pause the run, or continue a stopped run from its last checkpoint")
                self.resume_action = action
        help_menu = self.menuBar().addMenu("&Help")
        about = QAction("About Tunesmith", self)
        about.triggered.connect(
            lambda: QMessageBox.about(
                self, "Tunesmith", "Tunesmith Studio: point-and-click LoRA / QLoRA fine-tuning on your own GPU."
            )
        )
        help_menu.addAction(about)

    def _wire(self) -> None:
        """Every signal between the pages and the window, in one place."""
        self.steps.step_selected.connect(self._show_step)
        self.model_panel.report_ready.connect(
            lambda rep: self.steps.set_state(MODEL, "done" if rep and not self.model_panel.problem else "failed")
        )
        self.model_panel.model_chosen.connect(lambda _n: self.data_panel.model_changed())
        self.data_panel.status_changed.connect(self._data_status_changed)
        self.training_panel.gate_changed.connect(self._gate_changed)
        self.state.changed.connect(self._state_changed)
        self.training_panel.train_requested.connect(self.start_training)
        self.monitor_panel.pause_requested.connect(self.pause)
        self.monitor_panel.resume_requested.connect(self.resume)
        self.monitor_panel.stop_requested.connect(self.stop)
        self.export_panel.exported.connect(lambda _w: self.steps.set_state(EXPORT, "done"))
        self.chat_panel.replied.connect(lambda _r: self.steps.set_state(CHAT, "done"))
        self.hardware_panel.redetect_requested.connect(self.detect_hardware)
        self.runs_panel.resume_requested.connect(self.resume_run)
        self.runs_panel.continue_requested.connect(self.continue_with)
        self.runs_panel.source_selected.connect(self.follow_source)
        self.runs_panel.runs_changed.connect(self._runs_changed)

    # -- the Train gate -----------------------------------------------------------------------
    def train_blocker(self) -> str:
        """Why Train cannot start, in one sentence ("" when it can): the model must load (the
        demo, a Hub id, or a folder with config.json, weights and a tokenizer) and the data must
        hold at least one usable example. Data still loading does not block: the run checks it.
        The runs folder must take a new run (engine.api.write_problem)."""
        problems = model_problems(dict(self.state.get("model")))
        if problems:
            return f"The model cannot be trained on: {problems[0]}."
        dp = self.data_panel
        if not dp.loading and dp.checked_source == self.state.get("data.source") and dp.problem:
            return f"The data cannot be trained on: {dp.problem}"
        # A read-only, forbidden or full runs folder: said now, not after a minute of loading.
        return api.write_problem(self.state.get("output.dir"))

    def update_train_gate(self) -> None:
        self.training_panel.set_blocker(self.train_blocker())

    def _gate_changed(self, allowed: bool, tip: str) -> None:
        if self.train_action is not None:
            self.train_action.setEnabled(allowed)
            self.train_action.setToolTip(tip)

    def _state_changed(self, path: str) -> None:
        if path == "" or path.startswith(("model.", "data.source", "output.dir")):
            self.update_train_gate()

    def _data_status_changed(self) -> None:
        dp = self.data_panel
        if not dp.loading:
            self.steps.set_state(DATA, "failed" if dp.problem else "done")
        self.update_train_gate()

    def _show_step(self, step: int) -> None:
        self.pages.setCurrentIndex(step)
        if step == EXPORT:
            self.export_panel.refresh()
        elif step == CHAT:
            self.chat_panel.refresh()
        elif step == RUNS:
            self.runs_panel.refresh()
        elif step == HARDWARE:
            self.hardware_panel.refresh()

    def sync_run_menu(self) -> None:
        """Grey the Run menu's items that would do nothing now, as the Monitor's buttons are."""
        m = self.monitor_panel
        training = self.is_training()
        self.run_actions["Pause"].setEnabled(training and m.pause.isEnabled())
        self.run_actions["Stop"].setEnabled(training and m.stop.isEnabled())
        self.run_actions["Resume"].setEnabled(m.resume.isEnabled() if training else self.resume_target() is not None)

    def go_to(self, step: int) -> None:
        self.steps.select_step(step)

    # -- background start-up ----------------------------------------------------------------
    def start_background(self) -> None:
        """Called once the window is painted: hardware, model report and data preview."""
        self.detect_hardware()
        self.model_panel.refresh()
        self.data_panel.reload()
        run_task(_warm_engine, owner=self, on_done=self._warm_done, on_error=lambda m, _d: self._warm_done(0.0))

    def _warm_done(self, seconds: float) -> None:
        # torch + transformers + datasets leave ~600k objects on the heap; a full garbage
        # collection walking them takes ~400 ms with the GIL held, and one could start on the
        # worker thread in the middle of a run and freeze the window. Frozen objects are never
        # walked again (they are the libraries, alive for the whole session anyway).
        gc.freeze()
        # Paint the (hidden) Monitor page once now, so its first paint (fonts, axis pictures)
        # is not paid when Train switches to it mid-click.
        self.monitor_panel.resize(self.pages.size())
        self.monitor_panel.grab()
        self.engine_warm = True
        self.warmed_up.emit(seconds)

    def detect_hardware(self) -> None:
        run_task(
            _detect_hardware,
            owner=self,
            lane="hardware",
            on_done=self._hardware_ready,
            on_error=lambda m, _d: self.device_label.setText(f"Hardware detection failed: {m}"),
        )

    def _hardware_ready(self, profile) -> None:
        self.state.set_profile(profile)
        if profile.gpu_name:
            self.device_label.setText(f"{profile.gpu_name} · {profile.total_vram / 1024**3:.1f} GiB · {profile.kind}")
        else:
            self.device_label.setText(f"CPU only · {profile.cpu_count} cores")
            self.device_label.setToolTip(profile.kind_reason)

    # -- training ---------------------------------------------------------------------------
    def is_training(self) -> bool:
        return self.worker is not None and self.worker.is_running()

    def start_training(self) -> bool:
        if self.is_training():
            self.go_to(MONITOR)
            return False
        try:
            config = self.state.config()
        except ConfigError as exc:
            self.training_panel.validate()
            self.go_to(TRAIN)
            self.training_panel.banner.show_message(f"Fix the config before training: {exc}", "error")
            return False
        blocker = self.train_blocker()
        if blocker:
            self.update_train_gate()
            self.go_to(TRAIN)
            self.training_panel.banner.show_message(blocker, "error")
            return False
        return self._launch(config)

    def _launch(self, config, resume_from: Optional[str] = None) -> bool:
        """Start a run on the worker thread: a new one, or (`resume_from`, a run folder) the
        continuation of a stopped one from its latest checkpoint."""
        self.finished_event = None
        self._run_started_at = time.time()
        self._run_dir_now = None
        # A resumed run's folder is known now; a new run's once RunStarted names it.
        self.runs_panel.active_run = str(resume_from) if resume_from else None
        self.monitor_panel.begin()
        for step, st in ((TRAIN, "done"), (MONITOR, "active")):
            self.steps.set_state(step, st)
        self.training_panel.set_running(True)
        nproc = self.hardware_panel.processes()
        if nproc > 1:  # torchrun's ranks are processes of their own (studio.process_worker)
            self.worker = ProcessWorker(config, nproc, resume_from=resume_from)
        else:
            self.worker = TrainingWorker(config, resume_from=resume_from)
        # Queued explicitly: the slot must run on the GUI thread, never on the worker thread.
        self.worker.event.connect(self._on_event, Qt.ConnectionType.QueuedConnection)
        self.worker.finished.connect(self._worker_done)
        self.go_to(MONITOR)
        self.statusBar().showMessage(f"Resuming {Path(resume_from).name}…" if resume_from else "Training…")
        self.worker.start()
        self.sync_run_menu()
        return True

    def pause(self) -> None:
        if self.is_training():
            self.worker.pause()

    def resume(self) -> bool:
        """Run ▸ Resume: un-pause the run in progress; with none, continue a stopped or failed run
        from its last checkpoint (the one selected on the Runs page when that page is showing,
        else the last run of this session, else the one selected on the Runs page)."""
        if self.is_training():
            self.worker.resume()
            return True
        target = self.resume_target()
        if target is None:
            self.statusBar().showMessage("Nothing to resume: no stopped or failed run with a checkpoint.", 10000)
            return False
        return self.resume_run(target)

    def resume_target(self) -> Optional[str]:
        selected = self.runs_panel.current()
        selected_dir = str(selected.path) if selected is not None else None
        candidates = [self.state.last_run_dir, selected_dir]
        if self.pages.currentWidget() is self.runs_panel:
            candidates.reverse()
        return next((c for c in candidates if c and not self._why_not_resumable(c)), None)

    def _why_not_resumable(self, run_dir: str) -> str:
        """The engine's one resume decision (cheap: never the whole history), told whether this
        window is training the run now (its lock may not be written yet)."""
        ours = self.is_training() and bool(self._run_dir_now) and Path(self._run_dir_now) == Path(run_dir)
        return api.RunFolder(run_dir).why_not_resumable(ours=ours)

    def resume_run(self, run_dir: str) -> bool:
        """Continue a stopped or failed run from its latest checkpoint, with the config it was
        started with (its config.yaml), exactly as `tunesmith train --resume RUN` does: same
        data order, RNG, optimizer and schedule, so the losses match an uninterrupted run."""
        if self.is_training():
            self.runs_panel.banner.show_message("A run is in progress: stop it before resuming another.", "warning")
            return False
        why = self._why_not_resumable(run_dir)
        if not why:
            try:
                config = api.RunConfig.load(api.RunFolder(run_dir).config)
            except ConfigError as exc:
                why = f"Cannot resume {Path(run_dir).name}: {exc}"
        if why:
            self.runs_panel.banner.show_message(why, "error")
            self.statusBar().showMessage(why, 10000)
            return False
        return self._launch(config, resume_from=str(run_dir))

    def continue_with(self, adapter: str, method: str) -> bool:
        """Runs ▸ Continue with: the Train page set up for a new run of `method` from `adapter` (a
        run's final adapter or checkpoint); the person picks its data and presses Train. The Train
        page's banner says what was set up, or why nothing was (a config.yaml this version rejects)."""
        ok = self.training_panel.continue_from(adapter, method, METHOD_LABELS.get(method, method))
        self.go_to(TRAIN)
        return ok

    def follow_source(self, path: str) -> None:
        """The run or checkpoint picked on the Runs page is the one Chat and Export use."""
        self.chat_panel.refresh(select=path)
        self.export_panel.refresh(select=path)

    def _runs_changed(self) -> None:
        # A run was renamed or deleted: Chat and Export must not offer the old folder.
        self.chat_panel.refresh()
        self.export_panel.refresh()

    def stop(self) -> None:
        if self.is_training():
            self.monitor_panel.stopping()
            self.worker.stop()

    def _on_event(self, event) -> None:
        m = self.monitor_panel
        if not isinstance(event, (api.StepMetrics, api.LogLine)):
            QTimer.singleShot(0, self.sync_run_menu)  # after this event has set the Monitor's buttons
        if isinstance(event, api.StepMetrics):
            m.step(event)
        elif isinstance(event, api.LogLine):
            # An error line is the failure's sentence: one line here, the rest is in log.txt.
            m.append_log(one_sentence(event.message) if event.level == "error" else event.message, event.level)
        elif isinstance(event, api.RunStarted):
            self._run_dir_now = event.run_dir
            self.state.last_run_dir = event.run_dir
            self.runs_panel.active_run = event.run_dir
            if self.pages.currentWidget() is self.runs_panel:
                self.runs_panel.refresh()
            # The pre-flight of this run follows RunStarted; the last run's must not linger.
            self.training_panel.clear_preflight()
            m.run_started(event)
            self.state.run_dir_changed.emit(event.run_dir)
            # "Resuming …" was true until now: the run is training from here on.
            self.statusBar().showMessage("Training…")
        elif isinstance(event, api.CheckpointSaved):
            m.append_log(f"Checkpoint saved at step {event.step}: {event.path}")
        elif isinstance(event, api.Paused):
            m.paused(event.step, event.reason)
            self.statusBar().showMessage(f"Paused at step {event.step}")
            # The live probe: Chat talks to the paused run's current weights (in-process runs).
            probe = getattr(self.worker, "probe", None)
            if probe is not None and not event.reason:
                self.chat_panel.set_probe(probe, event.step)
        elif isinstance(event, api.EvalMetrics):
            m.eval_metrics(event)
        elif isinstance(event, api.GalleryAnswers):
            m.gallery_answers(event)
        elif isinstance(event, api.CompletionSamples):
            m.completions(event)
        elif isinstance(event, (api.MemoryAdjusted, api.RolledBack, api.DiskFull, api.PreflightResult)):
            m.notice(event)
            if isinstance(event, api.PreflightResult) or (
                isinstance(event, api.MemoryAdjusted) and event.phase == "preflight"
            ):
                self.training_panel.show_preflight(event)
        elif isinstance(event, api.Resumed):
            self.chat_panel.clear_probe()
            m.resumed(event.step)
            self.statusBar().showMessage("Training…")
        elif isinstance(event, api.Finished):
            self.chat_panel.clear_probe()
            self.finished_event = event
            self.state.last_run_dir = event.run_dir
            m.finished(event)
            self.steps.set_state(MONITOR, "done")
            self.statusBar().showMessage(("Stopped" if event.stopped else "Finished") + f": {event.run_dir}", 10000)
            # The run that just ended is the one to export or chat with (its newest adapter; its
            # best checkpoint by eval loss, when it has one, is listed first beside it).
            self.export_panel.refresh(select=str(event.run_dir))
            self.chat_panel.refresh(select=str(event.run_dir))
        elif isinstance(event, api.Failed):
            self.chat_panel.clear_probe()
            self.finished_event = event
            m.failed(event, self._write_details(event))
            for step in (TRAIN, MONITOR):
                self.steps.set_state(step, "failed")
            self.statusBar().showMessage(f"The run failed: {one_sentence(event.message)}", 10000)

    def _failed_run_dir(self) -> Optional[Path]:
        """The folder of the run that just failed: named by RunStarted, or (a failure before it)
        the newest run folder made since Train was pressed."""
        if self._run_dir_now:
            return Path(self._run_dir_now)
        try:
            runs = api.list_runs(self.state.get("output.dir"))
        except Exception:  # no runs folder yet: nothing was made
            return None
        for info in runs:
            try:
                if info.path.stat().st_mtime >= self._run_started_at - 1:
                    return info.path
            except OSError:
                continue
        return None

    def _write_details(self, event) -> str:
        """Append the failure's traceback to the run's log.txt (or, when no run folder was made,
        to a file of its own in the runs folder); returns that file, or "" when none was written."""
        detail = (event.detail or "").rstrip()
        if not detail:
            return ""
        # The session wrote the failure's sentence to log.txt already; the traceback follows it.
        text = f"{detail}\n"
        run_dir = self._failed_run_dir()
        try:
            if run_dir is not None and run_dir.is_dir():
                path = api.RunFolder(run_dir).log
            else:
                folder = Path(self.state.get("output.dir")).expanduser()
                folder.mkdir(parents=True, exist_ok=True)
                path = api.failure_log(folder)
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            return ""
        return str(path)

    def _worker_done(self) -> None:
        # Queued after every event the worker emitted, so the outcome is already shown.
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.wait()  # run() has returned; this only joins the thread
        self.training_panel.set_running(False)
        self.update_train_gate()
        self.runs_panel.active_run = None
        if self.pages.currentWidget() is self.runs_panel:
            self.runs_panel.refresh()
        self.run_finished.emit(self.finished_event)
        self.sync_run_menu()
        if self._close_after_stop:
            self._close_after_stop = False
            QTimer.singleShot(0, self.close)

    # -- closing ----------------------------------------------------------------------------
    def _ask(self, title: str, text: str) -> bool:
        answer = QMessageBox.question(
            self,
            title,
            text,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        return answer == QMessageBox.StandardButton.Yes

    def closeEvent(self, event) -> None:
        if self.is_training():
            # Nothing more is trained while the person decides: the run pauses after its current
            # step, and goes on if they keep the window (unless it was paused before).
            was_paused = self.monitor_panel.mode == "paused" or getattr(self.worker, "pause_asked", False)
            if self.monitor_panel.mode != "stopping":
                self.worker.pause()
            question = "A run is in progress (paused while you decide). Stop it (a checkpoint is saved) and close?"
            keep = not self.confirm("Stop training?", question)
            if keep:
                if not was_paused and self.is_training():
                    self.worker.resume()
                event.ignore()
                return
        if self.is_training():  # it may have ended by itself while the question was up
            # Stop asynchronously so the window stays responsive while the checkpoint is
            # written; the window closes itself when the worker thread has finished.
            self._close_after_stop = True
            self.stop()
            self.statusBar().showMessage("Stopping the run and saving a checkpoint before closing…")
            event.ignore()
            return
        self.settings.save_window(self.saveGeometry(), self.saveState())
        self.settings.sync()
        # Hand the libraries frozen in _warm_done back to the collector, so they are torn down
        # normally at exit (frozen, Triton's bindings report them as leaked).
        gc.unfreeze()
        super().closeEvent(event)
