"""The live probe (issue 14 item 7): while a run in the window is paused, the Chat page talks to
its current weights ("Talk to step N (paused)"), generating on a pool thread with the session's
own model; resuming is still exact: every loss after pause + probe + resume equals an
uninterrupted run's (fp32 on the CPU). Real runs of the demo model; nothing mocked."""

from __future__ import annotations

import numpy as np
import pytest
from studio_helpers import screenshot
from test_runs_page import configure, pause_at, step_losses, train

pytestmark = pytest.mark.slow


def test_a_probe_during_a_pause_leaves_the_run_exact(window, qtbot, runs_dir):
    from studio.main_window import CHAT
    from studio.panels.chat import PROBE

    configure(window, runs_dir, "straight", steps=6)
    train(window, qtbot)
    straight = step_losses(runs_dir / "straight")

    configure(window, runs_dir, "probed", steps=6)
    assert window.start_training()
    pause_at(window.worker, 3)
    qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=240_000)
    chat = window.chat_panel
    assert chat.source.currentData() == PROBE and chat.source.currentText().startswith("Talk to step 3 (paused)")
    assert not chat.load_button.isEnabled() and chat.send.isEnabled()

    window.go_to(CHAT)
    chat.prompt.setPlainText("The capital of France is")
    chat.max_tokens.setValue(12)
    with qtbot.waitSignal(chat.replied, timeout=120_000) as done:
        chat.generate()
    assert done.args[0]["step"] == 3 and done.args[0]["tuned"] == chat.tuned.toPlainText()
    assert "Step 3 (paused) answered" in chat.loaded.text()
    screenshot(window, "chat-probe")
    # Twice: the same weights and greedy decoding give the same answer.
    first = chat.tuned.toPlainText()
    with qtbot.waitSignal(chat.replied, timeout=120_000):
        chat.generate()
    assert chat.tuned.toPlainText() == first

    with qtbot.waitSignal(window.run_finished, timeout=240_000) as finished:
        window.resume()
    assert type(finished.args[0]).__name__ == "Finished" and not finished.args[0].stopped
    assert chat.source.findData(PROBE) < 0  # the probe entry leaves with the pause
    probed = step_losses(runs_dir / "probed")
    assert sorted(probed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([probed[s] for s in range(1, 7)], [straight[s] for s in range(1, 7)], rtol=1e-5)
