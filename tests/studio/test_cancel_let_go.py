"""Cancel for calls that cannot be interrupted (issue 28: Hub lookups and chat model loads could
not be stopped mid-call): the page hears Cancel at once, the next task of its lane does not wait
behind the call, and the call's late answer is dropped. Through studio.tasks with a call that never
looks at `cancelled` (as huggingface_hub's retries and transformers' from_pretrained do not), and
through the Chat page with the demo run's real model load."""

from __future__ import annotations

import threading

from PySide6.QtWidgets import QApplication
from studio_helpers import short_config

from studio import tasks


def test_a_call_that_cannot_stop_is_let_go_and_its_lane_goes_on(qtbot):
    from studio.warmup import ensure_warm

    ensure_warm()  # lanes run beside each other once the engine's imports are done
    started, release = threading.Event(), threading.Event()

    def lookup():  # deaf to `cancelled`, like a Hub read retrying inside huggingface_hub
        started.set()
        release.wait(300)
        return "late answer"

    answers, cancelled, after = [], [], []
    tasks.run_task(
        lookup,
        lane="lookups",
        key="lookup",
        interruptible=False,
        on_done=answers.append,
        on_cancelled=lambda: cancelled.append("cancelled"),
    )
    assert started.wait(60)
    tasks.run_task(lambda: "queued behind it", lane="lookups", on_done=after.append)
    assert tasks.cancel("lookup")
    qtbot.waitUntil(lambda: cancelled == ["cancelled"], timeout=10_000)
    tasks.run_task(lambda: "the next lookup", lane="lookups", key="lookup", interruptible=False, on_done=after.append)
    qtbot.waitUntil(lambda: after == ["queued behind it", "the next lookup"], timeout=60_000)
    assert not release.is_set()  # all of that while the first call still ran
    release.set()
    assert tasks.wait_all(60_000)  # the let-go call ended on its own thread ...
    QApplication.processEvents()  # deliver anything it emitted
    assert answers == [] and cancelled == ["cancelled"]  # ... and its answer was dropped


def test_quit_neither_waits_for_a_let_go_call_nor_starts_what_queued_behind_it(qtbot):
    from studio.warmup import ensure_warm

    ensure_warm()
    started, release = threading.Event(), threading.Event()

    def load():  # deaf to `cancelled`, like from_pretrained
        started.set()
        release.wait(300)

    ran = []
    tasks.run_task(load, lane="loads", interruptible=False)
    assert started.wait(60)
    tasks.run_task(lambda: ran.append("queued"), lane="loads")
    assert tasks.shutdown(100) is False  # the load still runs: Quit goes on without it (os._exit)
    assert ran == []
    release.set()
    assert tasks.wait_all(60_000) and ran == []


def test_chat_cancel_frees_the_page_at_once_and_drops_the_loaded_model(window, qtbot, runs_dir):
    short_config(window.state, runs_dir, "talk", steps=2)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=300_000)
    with qtbot.waitSignal(window.run_finished, timeout=300_000) as done:
        assert window.start_training()
    assert type(done.args[0]).__name__ == "Finished"
    cp = window.chat_panel
    cp.refresh(select=str(runs_dir / "talk"))
    cp.load_button.click()
    assert cp._busy and not cp.cancel_button.isHidden() and "Loading the base model" in cp.loaded.text()
    cp.cancel_button.click()  # at once: the load is still running (or its answer not yet delivered)
    assert not cp._busy and cp.cancel_button.isHidden() and cp.load_button.isEnabled()
    assert cp.loaded.text() == "Cancelled. Nothing loaded."
    assert tasks.wait_all(300_000)  # the load ran to its end on its own thread ...
    QApplication.processEvents()
    assert cp.model is None and cp.loaded.text() == "Cancelled. Nothing loaded."  # ... and was dropped
    # Load again: this one is kept.
    cp.load_button.click()
    qtbot.waitUntil(lambda: cp.model is not None, timeout=300_000)
    assert cp.loaded.text().startswith("Loaded ") and cp.cancel_button.isHidden()
