"""The Chat page's Tools…: tool definitions from a JSON file offered with every prompt, a bad file
named in the banner (the tools offered before stay), and a model whose template has no tools told
so while its replies still come. A real two-step demo run; nothing mocked."""

from __future__ import annotations

import json

import pytest

from tests.demo_runs import short_demo_run

pytestmark = pytest.mark.slow

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_tools_are_offered_and_a_bad_file_is_named(window, qtbot, runs_dir, tmp_path):
    from studio.main_window import CHAT

    short_demo_run(runs_dir, "tools")
    window.go_to(CHAT)
    chat = window.chat_panel
    chat.refresh()
    assert chat.source.count() > 0

    good = tmp_path / "tools.json"
    good.write_text(json.dumps({"tools": [WEATHER]}))
    assert chat.set_tools_file(str(good))
    assert chat.tools == [WEATHER]
    assert "get_weather" in chat.tools_label.text() and chat.clear_tools_button.isVisible()

    bad = tmp_path / "broken.json"
    bad.write_text('[{"type": "function", "function": {"description": "no name"}}]')
    assert not chat.set_tools_file(str(bad))
    assert chat.banner.level == "error" and str(bad) in chat.banner.text() and "tool 1" in chat.banner.text()
    assert chat.tools == [WEATHER]  # the good ones stay

    chat.prompt.setPlainText("Weather in Paris?")
    chat.max_tokens.setValue(6)
    with qtbot.waitSignal(chat.replied, timeout=180_000) as replied:
        chat.generate()
    assert isinstance(replied.args[0]["tuned"], str) and isinstance(replied.args[0]["base"], str)
    # The demo's template writes no tools: the page says so instead of pretending they were offered.
    assert chat.banner.level == "warning" and "has no tools" in chat.banner.text()

    chat.clear_tools()
    assert chat.tools is None and not chat.tools_label.isVisible()
