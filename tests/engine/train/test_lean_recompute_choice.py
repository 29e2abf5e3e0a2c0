"""fast_paths.lean_recompute: "auto" turns offload's lean recompute on for compute-bound models only
(engine.train.step.lean_recompute_choice), and prepare_model says which it chose and why."""

import pytest
import torch

from engine.config import FastPathConfig
from engine.train.step import LEAN_RECOMPUTE_MIN_HIDDEN, lean_recompute_choice, prepare_model
from tests.tiny_models import tiny_model


class _Base:
    def __init__(self, hidden):
        self.config = type("Config", (), {"hidden_size": hidden})()


@pytest.mark.parametrize(
    ("setting", "hidden", "on"),
    [
        ("auto", LEAN_RECOMPUTE_MIN_HIDDEN, True),  # Qwen3-8B's 4,096: faster and lower (measured)
        ("auto", 5120, True),
        ("auto", 2048, False),  # Llama-3.2-1B: launch-bound, slower with it (measured)
        ("auto", 1024, False),
        (True, 1024, True),  # the config's word wins
        (False, 8192, False),
    ],
)
def test_auto_follows_the_hidden_size_and_a_set_value_wins(setting, hidden, on):
    chosen, why = lean_recompute_choice(setting, _Base(hidden))
    assert chosen is on
    assert why == "set in config" if setting != "auto" else f"{hidden:,}" in why


@pytest.mark.parametrize(("setting", "on"), [("auto", False), (True, True)])
def test_prepare_model_reports_the_choice_and_the_offloader_follows_it(setting, on):
    model = tiny_model("llama", lora={})  # hidden far below the threshold: auto leaves it off
    prepared = prepare_model(model, FastPathConfig(lean_recompute=setting), torch.device("cpu"), True, offload="single")
    line = prepared.report["lean_recompute"]
    assert line.startswith("on:" if on else "off:"), line
    assert prepared.offloader.lean_recompute is on


def test_without_offload_it_says_so():
    model = tiny_model("llama", lora={})
    prepared = prepare_model(model, FastPathConfig(lean_recompute=True), torch.device("cpu"), True, offload="off")
    assert prepared.report["lean_recompute"] == "off: no offload"


def test_under_cuda_graphs_auto_takes_it_at_any_size_and_a_set_value_still_wins():
    """Replayed graphs make the row tiles' launches free (W1, W2 measured faster with it)."""
    from engine.train.step import lean_under_graphs

    assert lean_recompute_choice("auto", _Base(1024), graphs=True)[0] is True
    assert lean_recompute_choice(False, _Base(1024), graphs=True) == (False, "set in config")
    model = tiny_model("llama", lora={})
    prepared = prepare_model(model, FastPathConfig(), torch.device("cpu"), True, offload="double")
    assert prepared.offloader.lean_recompute is False  # small model, no graphs
    lean_under_graphs(prepared, "auto")
    assert prepared.offloader.lean_recompute is True
    assert prepared.report["lean_recompute"].startswith("on: CUDA graphs")
