"""Tool calls, on every family of the conformance suite whose real chat template writes them: a row in
OpenAI's fine-tuning form (an assistant message with tool_calls and no content, the tool's result, the
tool definitions in a "tools" column) trains the call as the template writes it (Qwen's <tool_call>
JSON, Llama's bare JSON, Mistral's [TOOL_CALLS], gpt-oss's channel, GLM's <arg_key> pairs) with the
token that ends it, and the answer after the result, never the question or the tool's result. A
template that cannot take the row refuses it in one sentence; none trains it without the call."""

from __future__ import annotations

import json

import pytest

from engine.data.formats import detect_format, row_to_messages
from engine.data.render import RowError, tokenize_example
from tests.conformance.families import FAMILIES, chat_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROW = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ],
    "tools": json.dumps(TOOLS),
}
WRITES_CALLS = [name for name, fam in FAMILIES.items() if "tool_calls" in chat_template(fam)]
# Families whose real template takes tool calls but not this row, and the words of its refusal.
REFUSED = {
    "deepseek-r1-llama": "this chat template does not write tool calls",  # its render leaves the call out
    "chatglm4": "where the chat template writes the call could not be found",  # ... and the answer turn
    "kimi-k2-thinking": "'append' of 'list' object is unsafe",  # transformers' sandbox refuses its list.append
    "kimi-k2-instruct": "'append' of 'list' object is unsafe",
    "functionary-v3.2": 'can only concatenate str (not "dict") to str',  # it wants the arguments as JSON text
}


def _messages():
    return row_to_messages(ROW, detect_format(["messages", "tools"]))


def _trained_text(tok, result) -> str:
    return tok.decode([i for i, on in zip(result.ids, result.trained) if on])


@pytest.mark.parametrize("name", WRITES_CALLS)
def test_a_tool_call_is_trained_as_the_template_writes_it(family_tokenizer, name):
    tok = family_tokenizer(name)
    if name in REFUSED:
        with pytest.raises(RowError, match=REFUSED[name].replace("(", r"\(").replace(")", r"\)")):
            tokenize_example(tok, _messages())
        return
    result = tokenize_example(tok, _messages())
    trained = _trained_text(tok, result)
    assert "get_weather" in trained and "Paris" in trained, trained  # the call, its name and argument
    assert "It is sunny in Paris." in trained, trained  # the answer after the result
    assert "sunny, 21C" not in trained and "Weather in Paris?" not in trained, trained
    # The call's span runs past the call to the token the template closes it with (<|im_end|>, <|eot_id|>,
    # </s>, gpt-oss's <|call|>, GLM's <|observation|>, Gemma-4's <|tool_response>): the model learns to stop.
    call = result.text[result.answers[0].start : result.answers[0].end].rstrip()
    assert not call.endswith(("}", "]", ")", "Paris")), call
    # The tools reached a template that reads them: it lists the function before the conversation.
    if "tools" in chat_template(FAMILIES[name]):
        assert 0 <= result.text.find("get_weather") < result.text.find("Weather in Paris?"), result.text


def test_the_count_the_readme_gives():
    assert len(WRITES_CALLS) == 52 and len(WRITES_CALLS) - len(REFUSED) == 47, WRITES_CALLS  # README's count


@pytest.mark.parametrize("name", ["phi-3.5", "smollm3", "granite-3.3", "lfm2"])
def test_a_template_without_tool_calls_refuses_the_row(family_tokenizer, name):
    with pytest.raises(RowError, match=r"this chat template does not write tool calls \(the call to get_weather"):
        tokenize_example(family_tokenizer(name), _messages())


@pytest.mark.parametrize(
    "name,end",
    [
        ("qwen3", "<|im_end|>"),
        ("llama-3.1", "<|eot_id|>"),
        ("gpt-oss", "<|call|>"),
        ("mistral-tekken", "</s>"),
        ("glm-4.6", "<|observation|>"),  # GLM's answers end with the next turn's opening: a call's is the tool's
        ("glm-4.7", "<|observation|>"),
    ],
)
def test_a_row_that_ends_with_its_call_trains_the_call_and_its_stop(family_tokenizer, name, end):
    """Function-calling sets often end a row at the call (no result, no answer after it)."""
    tok = family_tokenizer(name)
    row = {"messages": ROW["messages"][:2], "tools": ROW["tools"]}
    result = tokenize_example(tok, row_to_messages(row, detect_format(["messages", "tools"])))
    trained = _trained_text(tok, result)
    assert "get_weather" in trained and trained.rstrip().endswith(end), trained
    assert "Weather in Paris?" not in trained


@pytest.mark.parametrize("name", ["qwen3", "llama-3.1", "mistral-tekken", "gpt-oss"])
def test_a_chat_offers_the_tools_as_training_wrote_them(family_tokenizer, name, tmp_path):
    """`tunesmith chat --tools` (engine.chat.chat_prompt): the definitions a tools file holds reach the
    prompt the way a training row's tools column reached the trained text."""
    from engine.chat import chat_prompt, load_tools, template_uses_tools

    tok = family_tokenizer(name)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    tools = load_tools(path)
    assert template_uses_tools(tok)
    question = ROW["messages"][0]["content"]
    prompt = chat_prompt(tok, question, tools=tools)
    assert "get_weather" in prompt and "The weather of a city" in prompt
    assert "get_weather" not in chat_prompt(tok, question)
    row = {"messages": ROW["messages"][:2], "tools": ROW["tools"]}
    trained_on = tokenize_example(tok, row_to_messages(row, detect_format(["messages", "tools"])))
    assert trained_on.text.startswith(prompt[: prompt.index("get_weather")])
