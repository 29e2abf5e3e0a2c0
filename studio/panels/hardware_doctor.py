"""The Hardware page's "Ready to train?" card: the checks of `tunesmith doctor` (studio.doctor), run on a pool
thread when asked (they compile a Triton kernel and run an NF4 matmul in child processes: seconds to a minute),
one line per check with the command that fixes what is missing."""

from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QWidget

from engine.api import doctor_report
from studio import doctor
from studio.panels.common import card
from studio.tasks import run_task


class DoctorCard(QWidget):
    def __init__(self, runs_dir=None, parent=None):
        """`runs_dir`: a callable giving the folder runs go to (its free disk is checked)."""
        super().__init__(parent)
        self.runs_dir = runs_dir or (lambda: None)
        frame, lay = card()
        head = QHBoxLayout()
        head.addWidget(QLabel("<b>Ready to train?</b> The checks of <code>tunesmith doctor</code>"))
        head.addStretch(1)
        self.button = QPushButton("Check this machine")
        self.button.clicked.connect(self.run_checks)
        head.addWidget(self.button)
        lay.addLayout(head)
        self.verdict = QLabel("Not checked yet.")
        self.verdict.setObjectName("doctorVerdict")
        self.verdict.setWordWrap(True)
        lay.addWidget(self.verdict)
        self.report = QPlainTextEdit()
        self.report.setReadOnly(True)
        self.report.setObjectName("doctorReport")
        self.report.setMaximumHeight(220)
        lay.addWidget(self.report)
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(frame)
        self.checks = None  # the last answer (a list of engine.api.DoctorCheck)

    def run_checks(self) -> None:
        self.button.setEnabled(False)
        self.verdict.setText("Checking: Python, the environment, torch, the driver, Triton, bitsandbytes, Qt, …")
        run_task(
            doctor.checks,
            self.runs_dir(),
            owner=self,
            lane="hardware",
            key="doctor",
            on_done=self._show,
            on_error=self._failed,
        )

    def _show(self, checks) -> None:
        self.checks = checks
        lines: list[str] = []
        code = doctor_report(checks, out=lines.append)
        self.report.setPlainText("\n".join(lines[:-1]))
        self.verdict.setText(("✔ " if code == 0 else "✘ ") + lines[-1].removeprefix("tunesmith doctor: "))
        self.button.setEnabled(True)

    def _failed(self, message: str, detail: str = "") -> None:
        self.verdict.setText(f"The checks did not finish: {message}")
        self.report.setPlainText(detail)
        self.button.setEnabled(True)
