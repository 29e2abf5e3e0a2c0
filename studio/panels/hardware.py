"""Hardware page: what the engine's hardware detection found on this machine and the defaults its policy
chooses for the current config, with the reason for each. With more than one GPU it offers "Train on
N GPUs": such a run is N processes under torchrun (studio.process_worker), not the in-process worker.
Where a run cannot keep the machine awake (no sleep inhibitor: a container, no desktop session), it
says so once, in plain words, with how to prevent it (engine.api.sleep_lock_problem, asked once on a
pool thread when the hardware is known).

`TUNESMITH_CPU_PROCESSES=N` offers N processes on a machine without GPUs (gloo): for trying the
multi-process path on a laptop CPU and for the tests."""

from __future__ import annotations

import os

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from studio.panels.common import Banner, card, fmt_bytes, title, value_label
from studio.panels.hardware_doctor import DoctorCard
from studio.tasks import run_task


class HardwarePanel(QWidget):
    redetect_requested = Signal()

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.banner = Banner()
        self.fields = {k: value_label() for k in ("kind", "gpu", "memory", "host", "software", "note")}
        prof, prof_lay = card()
        prof_lay.addWidget(QLabel("<b>This machine</b>"))
        form = QFormLayout()
        for key, label in (
            ("kind", "Class"),
            ("gpu", "GPU"),
            ("memory", "Memory"),
            ("host", "Host"),
            ("software", "Software"),
            ("note", "Note"),
        ):
            form.addRow(label, self.fields[key])
        # Live: the GPU's utilisation, temperature and power (NVML), read every 2 s while this page
        # shows; the row stays hidden where NVML has nothing to say (a CPU machine).
        self.health = value_label()
        self.health.setObjectName("gpuHealth")
        form.addRow("GPU now", self.health)
        self._health_row = form.rowCount() - 1
        self._form = form
        form.setRowVisible(self._health_row, False)
        self._health_timer = QTimer(self, interval=2000)
        self._health_timer.timeout.connect(self.poll_health)
        prof_lay.addLayout(form)
        self.sleep_note = value_label()
        self.sleep_note.setObjectName("sleepNote")
        self.sleep_note.setWordWrap(True)
        self.sleep_note.hide()
        prof_lay.addWidget(self.sleep_note)
        self._sleep_asked = False
        self.sleep_known = False  # the answer has come back
        # Several GPUs: how many a run uses (1 = in this process, as always).
        self.gpus = QSpinBox()
        self.gpus.setRange(1, 1)
        self.gpus.setToolTip(
            "More than 1: the run is that many processes under torchrun, one per GPU; each trains on its "
            "share of every step and the adapters' gradients are averaged (training.grad_accum must be a "
            "multiple of the number)."
        )
        self.gpus_row = QWidget()
        gl = QHBoxLayout(self.gpus_row)
        gl.setContentsMargins(0, 0, 0, 0)
        gl.addWidget(QLabel("Train on"))
        gl.addWidget(self.gpus)
        self.gpus_unit = QLabel("GPUs")
        gl.addWidget(self.gpus_unit)
        gl.addStretch(1)
        self.gpus_row.hide()
        prof_lay.addWidget(self.gpus_row)
        again = QPushButton("Detect again")
        again.clicked.connect(self.redetect_requested)
        head = QHBoxLayout()
        head.addStretch(1)
        head.addWidget(again)
        prof_lay.addLayout(head)
        self.defaults = QPlainTextEdit()
        self.defaults.setReadOnly(True)
        self.defaults.setObjectName("hardwareReport")
        dfl, dfl_lay = card()
        dfl_lay.addWidget(QLabel("<b>Defaults chosen for the current config</b>"))
        dfl_lay.addWidget(self.defaults, 1)

        lay = QVBoxLayout(self)
        lay.addWidget(title("Hardware", "What the engine found, and the settings it picks for it."))
        lay.addWidget(self.banner)
        lay.addWidget(prof)
        lay.addWidget(dfl, 1)
        # The checks of `tunesmith doctor`, run when asked.
        self.doctor = DoctorCard(lambda: self.state.data["output"]["dir"])
        lay.addWidget(self.doctor)
        for f in self.fields.values():
            f.setText("Detecting…")
        state.profile_changed.connect(lambda _p: self.refresh())
        state.changed.connect(lambda _p: self.refresh() if self.isVisible() else None)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.poll_health()

    def hideEvent(self, event) -> None:
        super().hideEvent(event)
        self._health_timer.stop()

    def poll_health(self) -> None:
        p = self.state.profile
        health = None
        if p is not None and p.gpu_name:
            try:
                from engine.api import gpu_health

                health = gpu_health(0)
            except Exception:  # an answer from NVML is a bonus, never a reason to fail the page
                health = None
        self._form.setRowVisible(self._health_row, health is not None)
        if health is None:
            self._health_timer.stop()
            return
        parts = [
            f"{health.utilization}% busy" if health.utilization is not None else "",
            f"{health.temperature} °C" if health.temperature is not None else "",
            (f"{health.power_watts:.0f} W" if health.power_watts is not None else "")
            + (f" of {health.power_limit_watts:.0f} W" if health.power_watts and health.power_limit_watts else ""),
        ]
        self.health.setText(" · ".join(x for x in parts if x))
        if not self._health_timer.isActive():
            self._health_timer.start()

    def check_sleep_lock(self) -> None:
        """Ask once whether a run can keep the machine awake (it starts a helper process, so on a
        pool thread); show the answer only when it cannot."""
        if self._sleep_asked:
            return
        self._sleep_asked = True
        from engine.api import sleep_lock_problem

        run_task(sleep_lock_problem, owner=self, on_done=self._show_sleep_note, lane="hardware")

    def _show_sleep_note(self, sentence) -> None:
        self.sleep_note.setText(sentence or "")
        self.sleep_note.setVisible(bool(sentence))
        self.sleep_known = True

    def processes(self) -> int:
        """How many processes the next run uses (1: in this process)."""
        return self.gpus.value() if self.gpus_row.isVisible() or self.gpus.value() > 1 else 1

    def _offer_gpus(self, p) -> None:
        count = p.gpu_count if p.gpu_name else 0
        unit = "GPUs"
        if count < 2:
            try:
                count = int(os.environ.get("TUNESMITH_CPU_PROCESSES", "0")) if not p.gpu_name else 0
            except ValueError:
                count = 0
            unit = "CPU processes (gloo)"
        self.gpus.setRange(1, max(1, count))
        self.gpus_unit.setText(unit)
        self.gpus_row.setVisible(count > 1)

    def refresh(self) -> None:
        p = self.state.profile
        if p is None:
            return
        self._offer_gpus(p)
        self.check_sleep_lock()
        cap = f"compute {p.compute_capability[0]}.{p.compute_capability[1]}" if p.compute_capability else ""
        self.fields["kind"].setText(f"<b>{p.kind}</b> — {p.kind_reason}")
        self.fields["gpu"].setText(
            f"{p.gpu_name} ×{p.gpu_count}, {cap}, bf16 {'yes' if p.bf16_supported else 'no'}"
            if p.gpu_name
            else "none (training runs on the CPU)"
        )
        self.fields["memory"].setText(
            (
                f"{fmt_bytes(p.total_vram)} VRAM ({fmt_bytes(p.free_vram)} free)"
                f"{' unified' if p.integrated_memory else ''}; "
                if p.gpu_name
                else ""
            )
            + f"RAM {fmt_bytes(p.ram_total)} ({fmt_bytes(p.ram_available)} available)"
        )
        if p.gpu_name:
            try:
                from engine.api import device_memory

                # Every process on the card, not only this one: on a laptop the desktop uses it too.
                m = device_memory(0, unified=p.integrated_memory)
            except Exception:  # an answer from NVML is a bonus, never a reason to fail the page
                m = None
            if m is not None:
                self.fields["memory"].setText(
                    self.fields["memory"].text()
                    + f"; in use by all programs now: {fmt_bytes(m.used)} of {fmt_bytes(m.total)} ({m.source})"
                )
        self.fields["host"].setText(f"{p.os} {p.arch}, {p.cpu_count} CPUs")
        self.fields["software"].setText(
            f"torch {p.torch_version or 'missing'}, CUDA {p.cuda_version or 'none'}"
            + (f", driver {p.driver_version}" if p.driver_version else "")
            + f", Triton {'yes' if p.triton_available else 'no'}"
        )
        self.fields["note"].setText(p.note or "—")
        try:
            from engine.api import format_profile

            cfg = self.state.config()
            text = format_profile(p, cfg)
            # The machine part is in the form above; show the defaults part.
            self.defaults.setPlainText(text.split("\n\n", 1)[-1])
        except Exception as exc:  # an invalid config is shown on the Train page
            self.defaults.setPlainText(f"Cannot work out the defaults for the current config: {exc}")
