"""A 4-bit base with training.distributed fsdp (issue 18 item 2): the window says the engine's one
sentence where it shows any invalid config, and Train refuses before anything starts."""

from __future__ import annotations


def test_4bit_under_fsdp_is_shown_and_refused(window):
    state, page = window.state, window.training_panel
    state.set("model.load_in_4bit", True)
    state.set("training.distributed", "fsdp")
    assert not page.validate()
    assert "a 4-bit base is not sharded across GPUs here" in page.train_reason.text()
    assert not window.start_training()
    assert "a 4-bit base is not sharded across GPUs here: use DDP" in page.banner.text()
    state.set("training.distributed", "ddp")
    assert window.state.error() is None
