"""Monitor page: live charts of loss (raw and smoothed), learning rate, gradient norm,
tokens/s, step time and memory; a progress bar with ETA; Pause, Resume, Stop; the log; and a
warning when a fast path the run asked for did not run in a step, or ran on some layers only
(the step's counted calls and fallbacks against the run's fast-path report).

What the session did to keep the run going shows as a banner (`notice`): a setting lowered
after running out of memory (MemoryAdjusted), a rollback after a NaN or a loss spike
(RolledBack), a full disk (DiskFull, with the pause it causes); the measured pre-flight
(PreflightResult) shows its peak, step time and ETA on a line under the status.

The eval loss on held-out examples (EvalMetrics) is a second curve on the Loss chart; the
gallery's answers at each checkpoint (GalleryAnswers) fill the Gallery tab beside the log; the
training method's own metrics (StepMetrics.metrics) and GRPO's sampled completions
(CompletionSamples) fill the Method tab (studio.widgets.method_view). On a
GPU the Memory chart also shows the whole card's used memory (every process: the desktop, a
browser), polled once a second through engine.api.device_memory, against the card's total.
After a Stop, Resume continues the stopped run from its checkpoint.

Events append to numpy buffers as they arrive; the charts redraw from a timer, one chart
per tick and only when it changed. A pyqtgraph chart costs 5-15 ms to repaint (mostly axis
text); redrawing all six in one event-loop pass would stall the window for ~100 ms, one per
pass keeps every pass short.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QTextCursor
from PySide6.QtWidgets import (
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine import api
from studio.panels.common import Banner, caption, fmt_bytes, fmt_seconds, title
from studio.widgets.gallery import GalleryView
from studio.widgets.live_chart import LiveChart
from studio.widgets.method_view import MethodView
from studio.widgets.series import Ema

GiB = 1024**3
MiB = 1024**2


def one_sentence(text: str) -> str:
    """The first non-empty line of a message, at most 300 characters."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "The run failed.")
    return line if len(line) <= 300 else line[:297] + "…"


# What a fast path's fallback cost, for the paths that are not a layer's kernels (those ran the
# stock layer): GRPO's decode loop (engine.train.decoding), whose refusal is counted as
# fallback:decode_loop with its reason.
_FELL_BACK_TO = {
    "decode_loop": "GRPO sampled its completions through transformers' generate, slower than the engine's decode loop",
}


class MonitorPanel(QWidget):
    pause_requested = Signal()
    resume_requested = Signal()
    stop_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.banner = Banner()
        self.status = QLabel("No run yet. Press Train on the Train page.")
        self.status.setObjectName("runStatus")
        self.status.setWordWrap(True)
        # Fixed sizes for the labels that change during a run: a label that grows re-lays out
        # the page, and every chart then re-renders at once (a visible hitch).
        self.status.setFixedHeight(40)
        self.progress = QProgressBar()
        # Before any run there is no step count to show (a bare bar read "0 / 100 steps").
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("no run yet")
        # The GPU's utilisation, temperature and power beside its memory; hidden on a CPU.
        self.health = caption("")
        self.health.setObjectName("gpuHealth")
        self.health.hide()
        self.eta = caption("")
        self.eta.setWordWrap(False)
        self.eta.setFixedWidth(450)
        self.pause = QPushButton("Pause")
        self.resume = QPushButton("Resume")
        self.stop = QPushButton("Stop")
        self.stop.setObjectName("danger")
        self.stop.setToolTip("Stop after the current step and save a checkpoint")
        self.pause.clicked.connect(self.pause_requested)
        self.resume.clicked.connect(self.resume_requested)
        self.stop.clicked.connect(self.stop_requested)
        self.set_controls("idle")
        # After a failure: opens the run's log.txt, where the traceback is (never in the log view).
        self.details = QPushButton("Details…")
        self.details.setToolTip("Open the run's log.txt, with the technical details of the failure")
        self.details.clicked.connect(self.open_details)
        self.details.hide()
        self.details_path = ""
        # The measured pre-flight (peak memory, step time, ETA); fixed height, like the status.
        self.preflight = caption("")
        self.preflight.setObjectName("preflightLine")
        self.preflight.setFixedHeight(22)
        self.preflight.hide()

        self.loss = LiveChart("Loss")
        self.loss.add_series("loss", "#aab7b8", width=1)
        self.loss.add_series("smoothed", "#2471a3", width=2)
        self.loss.add_series("eval", "#d35400", width=2, dashed=True)
        self.lr = LiveChart("Learning rate")
        self.lr.add_series("lr", "#7d3c98")
        self.grad = LiveChart("Gradient norm")
        self.grad.add_series("grad norm", "#ca6f1e")
        self.tps = LiveChart("Tokens / s")
        self.tps.add_series("tokens/s", "#1e8449")
        self.step_time = LiveChart("Step time", "s")
        self.step_time.add_series("seconds", "#b03a2e")
        # Always GiB and a fixed title: changing either mid-run re-lays out the plot.
        self.memory = LiveChart("Memory", "GiB")
        self.memory.setToolTip(
            "GPU: torch allocated / reserved / peak of this run, and the whole card's used memory (every "
            "process on it) against the card's total: the headroom that is really left. "
            "CPU: the process's resident memory (all three curves)."
        )
        self.memory.add_series("allocated", "#2874a6")
        self.memory.add_series("reserved", "#85c1e9", dashed=True)
        self.memory.add_series("peak", "#cb4335")
        self.memory.add_series("card used", "#7f8c8d", width=2, dashed=True)
        self.charts = [self.loss, self.lr, self.grad, self.tps, self.step_time, self.memory]
        self.ema = Ema(0.9)

        grid = QGridLayout()
        grid.setSpacing(6)
        for i, chart in enumerate(self.charts):
            grid.addWidget(chart, i // 3, i % 3)
        charts = QWidget()
        charts.setLayout(grid)

        self.log = QPlainTextEdit()
        self.log.setObjectName("logView")
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(5000)  # bounded, so a long run cannot grow it forever
        self.gallery = GalleryView()
        self.tabs = QTabWidget()
        self.tabs.addTab(self.log, "Log")
        self.tabs.addTab(self.gallery, "Gallery")
        # The training method's own metrics and GRPO's completions (empty for SFT).
        self.method = MethodView()
        self.tabs.addTab(self.method, "Method")

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(charts)
        split.addWidget(self.tabs)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)

        controls = QHBoxLayout()
        controls.addWidget(self.progress, 1)
        controls.addWidget(self.eta)
        controls.addWidget(self.pause)
        controls.addWidget(self.resume)
        controls.addWidget(self.stop)

        lay = QVBoxLayout(self)
        lay.addWidget(title("Monitor", "Watch the run live. Stop saves a checkpoint you can export or resume."))
        lay.addWidget(self.banner)
        status_row = QHBoxLayout()
        status_row.addWidget(self.status, 1)
        status_row.addWidget(self.details, 0, Qt.AlignmentFlag.AlignTop)
        lay.addLayout(status_row)
        lay.addWidget(self.preflight)
        lay.addWidget(self.health)
        lay.addLayout(controls)
        lay.addWidget(split, 1)

        self.last_step = 0
        self.total_steps = 0
        self.last_metrics = None
        self.notices: list[str] = []  # the recovery banners of this run, in order
        self.fast_paths: dict[str, str] = {}  # the run's report: name -> "on" | why off
        self.fast_path_warning = ""  # what the banner says about fast paths that did not run
        self._missing_seen: set = set()
        self._started = None  # when this session's first step landed (the ETA's clock)
        self._first_step = 0
        self._paused_at = None
        self._next_chart = 0
        self._redraw = QTimer(self, interval=40)
        self._redraw.timeout.connect(self._refresh_one)
        # The card as every process sees it; polled while a GPU run goes on (NVML: cheap).
        self.card_memory = None  # the last engine.api.DeviceMemory read
        self._card = None  # (gpu index, unified memory) of the run's device, None on a CPU
        self._card_timer = QTimer(self, interval=1000)
        self._card_timer.timeout.connect(self.poll_card)
        self.evals: list[tuple[int, float]] = []  # (step, eval loss) of this run

    # -- run lifecycle ----------------------------------------------------------------------
    def set_controls(self, mode: str) -> None:
        """mode: idle | running | paused | stopping."""
        self.pause.setEnabled(mode == "running")
        self.resume.setEnabled(mode == "paused")
        self.stop.setEnabled(mode in ("running", "paused"))
        self.mode = mode

    def begin(self) -> None:
        for chart in self.charts:
            chart.clear_data()
        self.ema.reset()
        self.banner.clear()
        self.log.clear()
        self.progress.setRange(0, 0)  # busy until RunStarted says how many steps
        self.progress.setFormat("%v / %m steps")
        self.details.hide()
        self.details_path = ""
        self.total_steps = 0
        self.status.setText("Preparing: loading the model and data…")
        self.preflight.setText("")
        self.preflight.hide()
        self.notices: list[str] = []
        self.eta.setText("")
        self.last_step = 0
        self.last_metrics = None
        self.fast_paths = {}
        self.fast_path_warning = ""
        self._missing_seen = set()
        self._started = None
        self.set_controls("running")
        self.resume.setToolTip("")
        self.gallery.clear()
        self.method.clear()
        self.evals = []
        self._card = None
        self.card_memory = None
        self.memory.set_limit(None)
        self.show_health()  # the last run's card readings are not this one's
        self._redraw.start()

    def run_started(self, ev) -> None:
        resumed_from = int(getattr(ev, "resumed_from_step", 0) or 0)
        if resumed_from and not self.last_step:
            # Resumed from the Runs page: the charts continue the run's history, not start over.
            self.show_history(ev.run_dir, resumed_from)
        self.total_steps = int(ev.total_steps)
        for chart in self.charts:
            chart.set_x_span(self.total_steps)
        self.method.set_x_span(self.total_steps)
        self.progress.setRange(0, max(1, self.total_steps))
        self.progress.setValue(int(getattr(ev, "resumed_from_step", 0) or 0))
        # The steps' count whoever started the run (Train sets it too; a run's replayed events may not).
        self.progress.setFormat("%v / %m steps")
        hw = ev.hardware or {}
        device = hw.get("gpu_name") or hw.get("device_name") or hw.get("kind") or ""
        world = int(getattr(ev, "world_size", 1) or 1)
        if world > 1:  # tokens/s and the step are the whole world's; memory is rank 0's card
            how = (ev.distributed or "ddp").upper()
            device = f"{world} × {device} ({how})" if hw.get("gpu_name") else f"{world} CPU processes ({how})"
        self.status.setText(f"Training in {ev.run_dir}" + (f" on {device}" if device else ""))
        # The ETA's clock starts at this session's first step: loading the model is not a step.
        self._started = None
        self._paused_at = None
        summary = ev.data_summary or {}
        if summary:
            self.append_log("data: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
        self.fast_paths = dict(ev.fast_paths or {})
        self._watch_card(hw, (ev.config or {}).get("training", {}).get("device", ""))
        if ev.fast_paths:
            self.append_log("fast paths: " + ", ".join(f"{k}: {v}" for k, v in ev.fast_paths.items()))

    def step(self, m) -> None:
        if self._started is None:
            self._started, self._first_step = time.monotonic(), int(m.step)
        self.last_step = int(m.step)
        self.total_steps = int(m.total_steps) or self.total_steps
        x = float(m.step)
        self.loss.append("loss", x, m.loss)
        self.loss.append("smoothed", x, self.ema.update(m.loss))
        self.lr.append("lr", x, m.lr)
        self.grad.append("grad norm", x, m.grad_norm)
        self.tps.append("tokens/s", x, m.tokens_per_second)
        self.step_time.append("seconds", x, m.step_seconds)
        self.method.add(int(m.step), getattr(m, "metrics", None) or {})
        on_gpu = m.device != "cpu" and m.mem_total > 0
        u = GiB
        self.memory.append("allocated", x, m.mem_allocated / u)
        self.memory.append("reserved", x, m.mem_reserved / u)
        self.memory.append("peak", x, m.mem_peak / u)
        if on_gpu and self.card_memory is None:
            self.memory.set_limit(m.mem_total / u, f"card {fmt_bytes(m.mem_total)}")
        self.progress.setMaximum(max(1, self.total_steps))
        self.progress.setValue(min(self.last_step, self.total_steps))
        self.last_metrics = m
        self.show_health(m.gpu_util, m.gpu_temp, m.gpu_power)
        self._update_eta(m)
        self._check_fast_paths(m)

    def show_history(self, run_dir: str, upto: int) -> None:
        """Draw a run's logged steps up to `upto` (its checkpoint) from metrics.jsonl."""
        try:
            hist = api.RunFolder(run_dir).history()
        except Exception:  # unreadable history: the charts start at the resumed step, as before
            return
        columns = {
            (self.loss, "loss"): "loss",
            (self.lr, "lr"): "lr",
            (self.grad, "grad norm"): "grad_norm",
            (self.tps, "tokens/s"): "tokens_per_second",
            (self.step_time, "seconds"): "step_seconds",
            (self.memory, "peak"): "mem_peak",
        }
        for i, step in enumerate(hist.steps):
            if step > upto:
                break
            for (chart, name), key in columns.items():
                values = hist.curves.get(key) or []
                if i < len(values) and values[i] == values[i]:  # NaN: not logged at this step
                    chart.append(name, float(step), values[i] / GiB if key == "mem_peak" else values[i])
            loss = hist.curves.get("loss") or []
            if i < len(loss) and loss[i] == loss[i]:
                self.loss.append("smoothed", float(step), self.ema.update(loss[i]))
            evals = hist.curves.get("eval_loss") or []
            if i < len(evals) and evals[i] == evals[i]:
                self.evals.append((int(step), float(evals[i])))
                self.loss.append("eval", float(step), float(evals[i]))
        self.last_step = min(upto, hist.steps[-1]) if hist.steps else 0

    # -- evaluation and the gallery -----------------------------------------------------------
    def eval_metrics(self, ev) -> None:
        """An EvalMetrics: a point on the eval curve; the status says the best so far."""
        self.evals.append((int(ev.step), float(ev.eval_loss)))
        self.loss.append("eval", float(ev.step), float(ev.eval_loss))
        held_out = dict(getattr(ev, "metrics", None) or {})
        # The method's own measures on the held-out examples (margins, accuracy, GRPO's reward of
        # greedy answers) go beside its training ones in the Method tab, dashed.
        self.method.add(int(ev.step), held_out, held_out=True)
        best = f" (best {ev.best_loss:.4f} at step {ev.best_step})" if ev.best_step else ""
        shown = ", ".join(f"{k} {v:.4g}" for k, v in list(held_out.items())[:4])
        self.append_log(
            f"eval loss {ev.eval_loss:.4f} at step {ev.step}{best}" + (f"; held-out {shown}" if shown else "")
        )
        if ev.stopping:
            self.append_log(
                f"early stopping: {ev.evals_without_improvement} evals without a better eval loss; "
                f"the best checkpoint is step {ev.best_step}"
            )

    def gallery_answers(self, ev) -> None:
        self.gallery.add(ev.step, list(ev.prompts), list(ev.answers))

    def completions(self, ev) -> None:
        """A CompletionSamples: GRPO's sampled completions with their rewards, in the Method tab."""
        self.method.add_samples(ev.step, list(ev.samples))

    # -- the card's memory, every process ----------------------------------------------------
    def _watch_card(self, hardware: dict, device: str) -> None:
        """Poll the card's device-wide memory while a GPU run goes on (not on a CPU)."""
        if not hardware.get("gpu_name") or str(device).startswith("cpu"):
            return
        index = 0
        if str(device).startswith("cuda:"):
            index = int(str(device).split(":", 1)[1] or 0)
        self._card = (index, bool(hardware.get("integrated_memory")))
        self.poll_card()
        self._card_timer.start()

    def show_health(self, util=None, temp=None, power=None, limit=None) -> None:
        """'GPU 87% busy · 64 °C · 412 W of 700 W'; hidden when nothing is known (a CPU run)."""
        parts = []
        if util is not None:
            parts.append(f"GPU {util}% busy")
        if temp is not None:
            parts.append(f"{temp} °C")
        if power is not None:
            parts.append(f"{power:.0f} W" + (f" of {limit:.0f} W" if limit else ""))
        self.health.setText(" · ".join(parts))
        self.health.setVisible(bool(parts))

    def poll_card(self) -> None:
        """One read of the card's used / total (NVML, or the OS on unified memory); a point on
        the Memory chart at the run's current step and the card's total as its limit line."""
        if self._card is None:
            self._card_timer.stop()
            return
        from engine.api import device_memory

        try:
            mem = device_memory(self._card[0], unified=self._card[1])
        except Exception:  # a driver hiccup must not disturb the run's page
            mem = None
        try:
            health = api.gpu_health(self._card[0])
        except Exception:  # as above
            health = None
        if health is not None:
            self.show_health(health.utilization, health.temperature, health.power_watts, health.power_limit_watts)
        if mem is None:
            return
        self.card_memory = mem
        self.memory.append("card used", float(self.last_step), mem.used / GiB)
        free = max(0, mem.total - mem.used)
        self.memory.set_limit(mem.total / GiB, f"card {fmt_bytes(mem.total)} · {fmt_bytes(free)} free")

    def _stop_card(self) -> None:
        self._card_timer.stop()

    def _check_fast_paths(self, m) -> None:
        """Warn when a requested fast path did not run in this step, or ran on some layers only.

        The banner changes only when the set of problems does (not every step), and the log
        gets each distinct problem once."""
        calls = getattr(m, "fast_path_calls", None) or {}
        fallbacks = getattr(m, "fallbacks", None) or {}
        if not self.fast_paths or not (calls or fallbacks):
            return  # nothing counted: a run from before the counters existed
        from engine.api import requested_but_not_run

        missing = requested_but_not_run(self.fast_paths, calls, fallbacks, str(m.device))
        if not missing:
            return
        new = False
        for path, what in missing.items():
            key = (path, what.split(":")[0].split(";")[0])
            if key not in self._missing_seen:
                self._missing_seen.add(key)
                new = True
                self.append_log(f"fast path {path} was requested but in step {m.step} {what}", "warning")
        if new or not self.fast_path_warning:
            lines = "; ".join(f"{path} {what}" for path, what in missing.items())
            layers = any(path not in _FELL_BACK_TO for path in missing)
            costs = ["Those layers ran the slower stock path"] if layers else []
            costs += [_FELL_BACK_TO[path] for path in missing if path in _FELL_BACK_TO]
            self.fast_path_warning = (
                f"Step {m.step}: requested fast paths did not all run: {lines}. {'; '.join(costs)} (see the log)."
            )
            self.banner.show_message(self.fast_path_warning, "warning")

    def _update_eta(self, m) -> None:
        # The ETA needs a step timed since the run (or its resume) started; the step's own
        # figures and what ran (the tooltip) are shown from the first step on.
        done = self.last_step - getattr(self, "_first_step", 0)
        eta = ""
        if done > 0 and self._started is not None:
            per_step = (time.monotonic() - self._started) / done
            eta = f" · ETA {fmt_seconds(max(0, self.total_steps - self.last_step) * per_step)}"
        # Packing metadata should be built once per micro-batch and never synced per layer.
        packing = f" · packing meta {m.metadata_builds}×, {m.host_syncs} syncs"
        offload = f" · offload {m.offload}" if getattr(m, "offload", "") else ""
        self.eta.setText(f"loss {m.loss:.3f} · {m.tokens_per_second:,.0f} tok/s{eta}{packing}{offload}")
        calls = getattr(m, "fast_path_calls", None) or {}
        ran = ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "nothing counted"
        self.eta.setToolTip(
            "Per step: how often the packed-sequence metadata was built (once per "
            "micro-batch is ideal) and how many device-to-host syncs it cost (0 is ideal on a "
            "GPU; on a CPU the reference attention's reads of the document bounds count); "
            "with offloaded checkpointing, the buffering used (double hides the copies).\n"
            f"Ran in the last step: {ran}."
        )

    def _clear_eta(self) -> None:
        """The ETA and per-step figures describe a run in progress: gone once it stops."""
        self.eta.setText("")
        self.eta.setToolTip("")

    def paused(self, step: int, reason: str = "") -> None:
        """`reason`: why the run paused itself (a full disk); "" when the person paused it."""
        self.set_controls("paused")
        # No ETA while nothing runs; the pause is not counted in the next one.
        self._clear_eta()
        self._paused_at = time.monotonic()
        if reason:
            first = reason.split(". ")[0].rstrip(".")
            self.status.setText(f"Paused at step {step}: {first}. Resume tries again; Stop keeps the last checkpoint.")
            self.status.setToolTip(reason)
            return
        self.status.setText(f"Paused after step {step}. Resume continues from here; Stop saves a checkpoint.")

    # -- what the session did to keep the run going ------------------------------------------
    def notice(self, ev) -> bool:
        """Show a MemoryAdjusted, RolledBack, DiskFull or PreflightResult event; False for any
        other event (the window routes those itself)."""
        kind = getattr(ev, "kind", "")
        if kind == "PreflightResult":
            self.show_preflight(ev)
        elif kind == "MemoryAdjusted" and ev.setting == "micro_batch" and ev.after > ev.before:
            # The rehearsal measured room the formula did not see: news, not a problem.
            self._warn(f"The pre-flight measured room on the card. Changed: {ev.message}", "info")
        elif kind == "MemoryAdjusted":
            where = "in the pre-flight rehearsal" if ev.phase == "preflight" else f"at step {ev.step}"
            self._warn(f"Ran out of memory {where}. Changed: {ev.message} Nothing is lost; the loss curve continues.")
        elif kind == "RolledBack":
            self._drop_points_after(ev.to_step)  # the steps after it run again
            self._warn(ev.message, "warning")
        elif kind == "DiskFull":
            # The one sentence (which disk, needed, free) and what to do; the rest is in the log.
            first = ev.message.split(". ")[0].rstrip(".")
            self._warn(f"{first}. Free some space: the run continues by itself (or press Resume).", "error")
        else:
            return False
        return True

    def _drop_points_after(self, step: int) -> None:
        """After a rollback: the curves end at the good step again, so the rerun steps draw on
        from there instead of doubling back."""
        for chart in [*self.charts, *self.method.charts.values()]:  # the method's curves too
            for name in list(chart._series):
                xs, ys = (a.copy() for a in chart.series(name).view())
                chart.series(name).clear()
                for x, y in zip(xs, ys):
                    if x <= step:
                        chart.append(name, float(x), float(y))
        if step == 0:
            self.ema.reset()
        self.last_step = step
        self.progress.setValue(min(step, self.total_steps))

    def _warn(self, text: str, level: str = "warning") -> None:
        self.notices.append(text)
        self.banner.show_message(text, level)

    def show_preflight(self, ev) -> None:
        """The rehearsal's measurement: peak memory against the card (CUDA), step time, ETA."""
        if ev.peak_bytes and ev.mem_total:
            peak = f"peak {fmt_bytes(ev.peak_bytes)} of {fmt_bytes(ev.mem_total)} ({ev.peak_bytes / ev.mem_total:.0%})"
        else:
            peak = "peak memory is measured on a GPU"
        rows = f"{ev.rows_per_micro_batch} {'row' if ev.rows_per_micro_batch == 1 else 'rows'}"
        text = (
            f"Pre-flight: {peak} · {ev.step_seconds:.2f} s per step · ETA {fmt_seconds(ev.eta_seconds)} · "
            f"{rows} × {ev.micro_batches_per_step} per step"
        )
        self.preflight.setText(text)
        self.preflight.setToolTip(ev.message)
        self.preflight.show()
        if not self.eta.text():
            self.eta.setText(f"ETA {fmt_seconds(ev.eta_seconds)} (pre-flight estimate)")

    def resumed(self, step: int) -> None:
        if self._paused_at is not None and self._started is not None:
            self._started += time.monotonic() - self._paused_at
        self._paused_at = None
        self.set_controls("running")
        self.status.setText(f"Training (resumed at step {step})")

    def stopping(self) -> None:
        self._clear_eta()
        self.set_controls("stopping")
        self.status.setText("Stopping after the current step and saving a checkpoint…")

    def finished(self, ev) -> None:
        self._clear_eta()
        self._stop_card()
        # The redraw timer finishes drawing chart by chart, then stops itself.
        self.set_controls("idle")
        if ev.stopped:
            # Resume continues the stopped run from its checkpoint (the window's resume()).
            self.resume.setEnabled(True)
            self.resume.setToolTip("Continue this run from its last checkpoint")
        summary = ev.summary or {}
        what = "Stopped" if ev.stopped else "Finished"
        loss = summary.get("final_loss", summary.get("loss"))
        extra = f", final loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
        best, best_step = summary.get("best_eval_loss"), summary.get("best_step")
        if isinstance(best, (int, float)) and best_step:
            extra += f", best eval loss {best:.4f} at step {best_step}"
        if summary.get("early_stopped"):
            what = "Stopped early (the eval loss stopped improving)"
        self.status.setText(
            f"✓ {what} at step {summary.get('steps', self.last_step)}{extra}. Run folder: {ev.run_dir}. "
            "Export it on the Export page, or try it on the Chat page."
        )
        self.progress.setRange(0, max(1, self.total_steps))

    def failed(self, ev, details_path: str = "") -> None:
        """One sentence in the window; the traceback is in `details_path` (the run's log.txt),
        behind the Details button."""
        self._clear_eta()
        self._stop_card()
        self.set_controls("idle")
        self.progress.setRange(0, max(1, self.total_steps))
        if not self.total_steps:
            self.progress.setFormat("did not start")  # not "0 / 1 steps": there were none
        text = one_sentence(ev.message)
        if ev.last_checkpoint:
            text += f" The last checkpoint is {ev.last_checkpoint}."
        self.status.setText("The run failed." + (" Details has the technical log." if details_path else ""))
        self.banner.show_message(text, "error")
        self.details_path = details_path
        self.details.setVisible(bool(details_path))

    def open_details(self) -> None:
        if self.details_path:
            QDesktopServices.openUrl(QUrl.fromLocalFile(self.details_path))

    # -- log and drawing --------------------------------------------------------------------
    def append_log(self, text: str, level: str = "info") -> None:
        stamp = time.strftime("%H:%M:%S")
        prefix = {"warning": "WARNING ", "error": "ERROR "}.get(level, "")
        self.log.appendPlainText(f"{stamp}  {prefix}{text}")
        self.log.moveCursor(QTextCursor.MoveOperation.End)

    def _refresh_one(self) -> None:
        for _ in range(len(self.charts)):
            chart = self.charts[self._next_chart]
            self._next_chart = (self._next_chart + 1) % len(self.charts)
            if chart.dirty:
                chart.refresh()
                return
        if self.mode == "idle":
            self._redraw.stop()  # the run is over and every chart shows its last point

    def refresh(self) -> None:
        for chart in self.charts:
            chart.refresh()
