"""`tunesmith chat`: a run's result in the terminal, through real subprocesses on a trained demo run,
and the tool definitions a chat may offer (`engine.chat.load_tools`), with the messages a user of a
bad file gets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.chat import ChatError, RunChat, load_tools
from tests.demo_runs import short_demo_run

WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def cli(*args, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A short demo run (2 steps): its folder holds config.yaml and the adapter."""
    return short_demo_run(tmp_path_factory.mktemp("runs"), "chat")


@pytest.mark.slow
def test_one_prompt_prints_the_runs_reply_and_base_is_the_adapter_off(run_dir):
    chat = RunChat(run_dir, device="cpu")
    tuned = chat.reply("What is 2 + 2?", 12)
    base = chat.reply("What is 2 + 2?", 12, use_adapter=False)
    out = cli("chat", str(run_dir), "--prompt", "What is 2 + 2?", "--max-new-tokens", "12", "--device", "cpu")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == tuned
    out = cli("chat", str(run_dir), "--prompt", "What is 2 + 2?", "--max-new-tokens", "12", "--base", "--device", "cpu")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == base


@pytest.mark.slow
def test_a_streamed_reply_is_the_reply(run_dir):
    """What a terminal is shown as the reply is made adds up to the reply itself."""
    chat = RunChat(run_dir, device="cpu")
    pieces = []
    reply = chat.reply("What is 3 + 4?", 16, on_text=pieces.append)
    assert len(pieces) >= 1 and "".join(pieces).strip() == reply == chat.reply("What is 3 + 4?", 16)


@pytest.mark.slow
def test_a_conversation_from_a_pipe_keeps_its_history_until_reset(run_dir):
    """Each line is a user turn answered after the turns before it; /reset starts over, /quit ends."""
    chat = RunChat(run_dir, device="cpu")
    first = chat.reply([{"role": "user", "content": "Hello"}], 8)
    second = chat.reply(
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Again"},
        ],
        8,
    )
    fresh = chat.reply([{"role": "user", "content": "Again"}], 8)
    out = cli(
        "chat",
        str(run_dir),
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        stdin="Hello\n\nAgain\n/reset\nAgain\n/quit\nignored\n",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == [first, second, "(a new conversation)", fresh]


@pytest.mark.slow
def test_a_bad_run_or_tools_file_is_named(run_dir, tmp_path):
    out = cli("chat", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert out.returncode == 2 and "nowhere" in out.stderr and "does not exist" in out.stderr
    bad = tmp_path / "tools.json"
    bad.write_text('[{"type": "function", "function": {"description": "no name"}}]')
    out = cli("chat", str(run_dir), "--prompt", "hi", "--tools", str(bad))
    assert out.returncode == 2 and str(bad) in out.stderr and "tool 1 has no function name" in out.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps([WEATHER]))
    out = cli("chat", str(run_dir), "--prompt", "hi", "--tools", str(good), "--max-new-tokens", "4", "--device", "cpu")
    # The demo's template has no tools: the reply comes, and the user is told they were not used.
    assert out.returncode == 0, out.stderr[-2000:]
    assert "chat template has no tools" in out.stderr


def test_load_tools_accepts_the_forms_a_data_set_has(tmp_path):
    path = tmp_path / "t.json"
    wrapped = {"type": "function", "function": WEATHER}
    # Kept as written: training hands a row's tools to the template as they are.
    for data, want in (([wrapped], [wrapped]), ([WEATHER], [WEATHER]), ({"tools": [WEATHER]}, [WEATHER])):
        path.write_text(json.dumps(data))
        assert load_tools(path) == want
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([WEATHER]).encode())  # Notepad's byte order mark
    assert load_tools(path) == [WEATHER]


@pytest.mark.parametrize(
    "text,words",
    [
        ("[{", "not JSON (line 1"),
        ("{}", "expected a JSON list of tool definitions"),
        ("[]", "expected a JSON list of tool definitions"),
        ('[{"type": "function", "function": {"name": "f"}}, {"type": "function"}]', "tool 2 has no function name"),
        ('[{"name": "f", "parameters": "city"}]', "tool 1 (f): parameters must be a JSON object"),
    ],
)
def test_load_tools_names_the_file_and_the_entry(tmp_path, text, words):
    path = tmp_path / "tools.json"
    path.write_text(text)
    with pytest.raises(ChatError) as err:
        load_tools(path)
    assert str(path) in str(err.value) and words in str(err.value)
    with pytest.raises(ChatError, match="no such tools file"):
        load_tools(tmp_path / "missing.json")
