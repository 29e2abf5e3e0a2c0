"""The Data page's thinking combo (data.thinking) on DeepSeek-V3.2's real template (the conformance
suite's folder): "auto" on a row with a reasoning field trains the reasoning in the example view;
"off" reaches the config (what a run and `tunesmith train` read) and the example is rendered again
with the reasoning left out; a loaded config's value shows in the combo. The Train page's form does
not edit it a second time."""

from __future__ import annotations

import json

from tests.conformance.families import build_family_folder

REASONING = "Air scatters short wavelengths."
ANSWER = "Because blue light scatters most."


def _trained(example) -> str:
    return "".join(piece for piece, trained in example.pieces if trained)


def test_thinking_combo_reaches_the_config_and_the_example(window, qtbot, tmp_path):
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    assert dp.thinking.currentData() == "auto" and "data.thinking" not in window.training_panel.form.fields
    window.state.set("model.name_or_path", str(build_family_folder("deepseek-v3.2")))
    row = {
        "messages": [
            {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        ]
    }
    path = tmp_path / "reasoning.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with qtbot.waitSignal(dp.example_ready, timeout=120_000):
        dp.load_source(str(path))
    qtbot.waitUntil(lambda: REASONING in _trained(dp.example), timeout=60_000)
    assert _trained(dp.example) == REASONING + "</think>" + ANSWER + "<｜end▁of▁sentence｜>"

    with qtbot.waitSignal(dp.example_ready, timeout=120_000):
        dp.thinking.setCurrentIndex(dp.thinking.findText("off"))
    assert window.state.get("data.thinking") is False
    assert window.state.config().data.thinking is False
    qtbot.waitUntil(lambda: _trained(dp.example) == ANSWER + "<｜end▁of▁sentence｜>", timeout=60_000)

    config = window.state.config().to_dict()
    config["data"]["thinking"] = True
    window.state.replace(config)
    assert dp.thinking.currentText() == "on"
