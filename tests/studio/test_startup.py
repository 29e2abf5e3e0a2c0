"""Start-up: the window opens before torch is imported, `studio.app.main` paints and reports
the time, and the Model and Hardware pages fill in from the engine in the background."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_process import child_env
from studio_helpers import screenshot

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = child_env(QT_QPA_PLATFORM="offscreen")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_window_constructs_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from PySide6.QtWidgets import QApplication\n"
        "app = QApplication([])\n"
        "from studio.main_window import MainWindow\n"
        "from studio.settings import Settings\n"
        f"w = MainWindow(Settings({str(tmp_path / 's.ini')!r}), {str(tmp_path / 'runs')!r})\n"
        "w.show(); app.processEvents()\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules))\n"
        "w.deleteLater(); app.processEvents()\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout


def test_app_main_paints_and_reports_time(tmp_path):
    code = (
        "from studio.app import main\n"
        f"raise SystemExit(main(['--quit-after-paint', '--settings', {str(tmp_path / 's.ini')!r}, "
        f"'--runs-dir', {str(tmp_path / 'runs')!r}]))\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "window painted" in out.stdout


def test_model_and_hardware_pages_fill_in(window, qtbot):
    from studio.main_window import HARDWARE, MODEL

    qtbot.waitUntil(lambda: window.state.profile is not None, timeout=60_000)
    qtbot.waitUntil(
        lambda: (
            window.model_panel.report is not None and window.model_panel.device_label.text() != "Detecting hardware…"
        ),
        timeout=60_000,
    )
    rep = window.model_panel.report
    assert rep["info"].model_type == "llama"
    assert "LlamaForCausalLM" in window.model_panel.fields["architecture"].text()
    assert window.model_panel.fields["layers"].text() == "4"
    need, verdict = window.model_panel.vram_labels["qlora4"]
    cpu = window.state.profile.kind == "cpu"
    # The 0.9M-parameter demo model fits any machine's memory; 4-bit needs a CUDA GPU.
    assert verdict.text() == ("needs CUDA" if cpu else "fits")
    assert window.model_panel.vram_labels["lora16"][1].text() == "fits"
    # The Model page lists what this machine will run, as the Train page does: on a CPU the
    # Triton kernels and the fused CE are off (the torch references run), on a GPU they are on.
    fast_paths = window.model_panel.fast_paths.text()
    if cpu:
        assert "– <b>RMSNorm kernel</b>: off on this machine" in fast_paths
        assert "– <b>fused cross-entropy</b>: off on this machine" in fast_paths
        assert "Training runs on the CPU" in window.model_panel.device_label.text()
    else:
        assert "✓ <b>RMSNorm kernel</b>: on" in fast_paths and "✓ <b>fused cross-entropy</b>: on" in fast_paths
    assert window.steps.state(MODEL) == "done"
    window.model_panel.refresh()  # one more round with the profile known, for the screenshot
    qtbot.waitUntil(lambda: "reading" not in window.model_panel.fields["name"].text(), timeout=30_000)
    window.go_to(MODEL)
    screenshot(window, "model")

    window.go_to(HARDWARE)
    qtbot.waitUntil(lambda: "Detecting" not in window.hardware_panel.fields["kind"].text(), timeout=30_000)
    kind = window.state.profile.kind
    assert f"<b>{kind}</b>" in window.hardware_panel.fields["kind"].text()
    defaults = window.hardware_panel.defaults.toPlainText()
    if cpu:
        # What this machine runs: the Hardware page turns the Triton kernels off on a CPU.
        assert "training.device = cpu" in defaults
        assert "fast_paths.kernels = false" in defaults and "fast_paths.fused_ce = false" in defaults
    else:
        assert "training.device = cuda" in defaults
    screenshot(window, "hardware")


def test_offline_hub_model_gives_a_clear_message(window, qtbot):
    window.model_panel.hub.setChecked(True)
    window.model_panel.hub_id.setEditText("Qwen/Qwen2.5-0.5B-Instruct")
    window.model_panel.use.click()
    qtbot.waitUntil(lambda: window.model_panel.banner.isVisible(), timeout=60_000)
    text = window.model_panel.banner.text()
    assert "Hub" in text and ("Local model folders" in text or "cache" in text), text
    # The demo still works afterwards.
    window.model_panel.demo.setChecked(True)
    window.model_panel.use.click()
    qtbot.waitUntil(
        lambda: window.model_panel.report is not None and window.model_panel.report["name"] == "demo", timeout=60_000
    )
    assert window.model_panel.banner.isHidden()


def test_window_geometry_and_recent_models_persist(qtbot, qapp, settings, runs_dir):
    from studio.main_window import MainWindow

    first = MainWindow(settings=settings, runs_dir=str(runs_dir))
    qtbot.addWidget(first)
    first.resize(720, 520)  # inside the offscreen screen, so restoring is not clamped
    first.show()
    qtbot.waitExposed(first)
    settings.add_recent_model("demo")
    size = (first.width(), first.height())  # the layout's minimum may have enlarged it
    first.close()
    second = MainWindow(settings=settings, runs_dir=str(runs_dir))
    qtbot.addWidget(second)
    assert settings.geometry() is not None and settings.window_state() is not None
    # Restored, not the 1200x800 default (the offscreen screen may clamp the width).
    assert second.height() == size[1] != 800
    assert second.model_panel.recent.itemText(0) == "demo"


@pytest.mark.slow  # the read that was let go retries for most of a minute before its late answer
def test_hub_read_shows_a_busy_bar_and_cancel_frees_the_page(window, qtbot, monkeypatch):
    """A Hub whose server accepts the connection and never answers: the page shows a busy bar
    with Cancel; Cancel says so at once, and the late answer changes nothing."""
    import socket

    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # the kernel completes the handshakes; nobody ever answers
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    mp = window.model_panel
    try:
        mp.hub.setChecked(True)
        mp.hub_id.setEditText("someone/never-answers")
        mp.use.click()
        assert mp.busy.isVisible() and mp.cancel_read.isVisible()
        mp.cancel_read.click()
        assert not mp.busy.isVisible() and "Stopped reading 'someone/never-answers'" in mp.banner.text()
        assert mp.report is None and "cancelled" in mp.problem
        # The read that was let go ends by its own timeout; its answer, delivered on the next event
        # turn, is ignored.
        from studio.tasks import wait_all

        assert wait_all(120_000), "the Hub read that was let go never returned"
        qtbot.wait(0)  # one event turn for the late answer, not a time
        assert "Stopped reading" in mp.banner.text() and not mp.busy.isVisible()
    finally:
        server.close()


def test_unreachable_hub_is_called_offline_after_one_short_probe(window, qtbot, monkeypatch):
    from huggingface_hub import constants

    probe = socket_port_closed()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{probe}")
    mp = window.model_panel
    mp.hub.setChecked(True)
    mp.hub_id.setEditText("someone/not-cached")
    mp.use.click()
    qtbot.waitUntil(lambda: mp.banner.isVisible() and "Offline" in mp.banner.text(), timeout=60_000)
    # Only the short reachability probe names the host it tried; huggingface_hub's download (with its
    # retries) ends in an "Offline" sentence without it.
    assert "127.0.0.1" in mp.banner.text() and not mp.busy.isVisible()


def socket_port_closed() -> int:
    """A local port with nothing listening (bound, then released)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
