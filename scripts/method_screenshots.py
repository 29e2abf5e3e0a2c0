"""The README's pictures of the training methods, taken offscreen from the real window: a short
DPO run on the demo model (pairs made from the demo data set: its answer chosen, another row's
answer rejected) with the Monitor's Method tab (reward margins, accuracy, log-probs), a short
GRPO run (the demo's prompts, a format reward and exact match against the `answer` column) with
its table of sampled completions, and a pair on the Data page side by side.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/method_screenshots.py [docs/screenshots]

Each picture is saved with a 256-colour palette so it stays small (< 200 KB). Runs go to a
temporary folder; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from studio import qt_compat  # noqa: E402

qt_compat.apply()

from PySide6.QtCore import QEvent, QThread  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.api import DEMO_DATA_FILE  # noqa: E402

SIZE = (1100, 560)


def wait(app, done, what: str, timeout: float = 600.0) -> None:
    """Run the event loop until `done()` (a script, not a test: it only needs to get there)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        app.processEvents()
        app.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)  # what the event loop would delete
        QThread.msleep(20)


def demo_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in DEMO_DATA_FILE.read_text().splitlines()[:n]]


def write_pairs(path: Path, n: int = 64) -> Path:
    rows, rng = demo_rows(n), random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            other = rows[(i + rng.randrange(1, n)) % n]["output"]
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            f.write(json.dumps({"prompt": prompt, "chosen": r["output"], "rejected": other}) + "\n")
    return path


def write_prompts(path: Path, n: int = 64) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in demo_rows(n):
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            f.write(json.dumps({"prompt": prompt, "answer": r["output"].removeprefix("Answer: ")}) + "\n")
    return path


def save(widget, path: Path, resize: bool = True) -> None:
    if resize:
        widget.resize(*SIZE)
    widget.repaint()
    image = widget.grab().toImage().convertToFormat(QImage.Format.Format_Indexed8)
    image.save(str(path), "PNG", 9)
    print(f"{path}: {path.stat().st_size / 1024:.0f} KB")


def configure(state, runs: Path, name: str, method: str, source: Path, steps: int) -> None:
    for key, value in (
        ("data.source", str(source)),
        ("data.max_seq_len", 128),
        ("training.method", method),
        ("training.max_steps", steps),
        ("training.rows_per_micro_batch", 2),
        ("training.grad_accum", 1),
        ("training.warmup_steps", 2),
        ("training.save_every", 0),
        ("training.log_every", 1),
        ("training.lr", 0.002),
        ("output.dir", str(runs)),
        ("output.run_name", name),
    ):
        state.set(key, value)


def train(app, window) -> None:
    ended = []
    window.run_finished.connect(ended.append)
    wait(app, lambda: window.engine_warm, "the engine's imports")
    if not window.start_training():
        raise SystemExit(f"Train refused: {window.train_blocker()}")
    wait(app, lambda: bool(ended), "the run")
    if type(ended[0]).__name__ != "Finished":
        raise SystemExit(f"the run failed: {ended[0]}")


def main(out: Path) -> None:
    from studio.app import load_style
    from studio.main_window import MainWindow
    from studio.settings import Settings

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tunesmith-shots-"))
    runs = tmp / "runs"
    runs.mkdir()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setStyle("Fusion")
    app.setStyleSheet(load_style())
    window = MainWindow(settings=Settings(tmp / "studio.ini"), runs_dir=str(runs))
    window.confirm = lambda *_: True
    window.resize(1200, 800)
    window.show()
    window.start_background()

    # A pair on the Data page, side by side.
    pairs = write_pairs(tmp / "pairs.jsonl")
    configure(window.state, runs, "dpo-demo", "dpo", pairs, 30)
    dp = window.data_panel
    dp.load_source(str(pairs))
    wait(app, lambda: dp.example is not None and getattr(dp.example, "sides", None), "the pair's example")
    window.go_to(1)  # the Data page, its Example tab
    dp.tabs.setCurrentIndex(1)
    save(dp, out / "data-pair.png", resize=False)

    # DPO: the Method tab's margins, accuracy and log-probs.
    train(app, window)
    monitor = window.monitor_panel
    monitor.tabs.setCurrentWidget(monitor.method)
    monitor.method.refresh()
    save(monitor.method, out / "method-dpo.png")

    # GRPO: the completions table with each reward.
    prompts = write_prompts(tmp / "prompts.jsonl")
    configure(window.state, runs, "grpo-demo", "grpo", prompts, 8)
    for key, value in (
        ("grpo.group_size", 4),
        ("grpo.max_new_tokens", 12),
        ("grpo.beta", 0.04),
        (
            "grpo.rewards",
            [
                {"kind": "regex", "pattern": r"(?s).*\d.*"},  # any digit: the untrained model scores 0 or 1
                {"kind": "exact", "column": "answer", "pattern": r"Answer: (.+)"},
            ],
        ),
    ):
        window.state.set(key, value)
    train(app, window)
    monitor.tabs.setCurrentWidget(monitor.method)
    monitor.method.refresh()
    save(monitor.method, out / "method-grpo.png")
    window.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots"))
    os._exit(0)  # the window's background threads end with the process
