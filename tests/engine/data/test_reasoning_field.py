"""An answer's reasoning in a field of its own (`reasoning_content`, `reasoning`, `thinking`) reaches
the chat template, on real upstream templates (tests/conformance/families.py): Qwen3's reads
`reasoning_content` and renders the row exactly as the same row with the reasoning written inline;
DeepSeek-V3.2's reads `reasoning_content` (and, like its template does without `thinking`, leaves it
out of the render); DeepSeek-V3.1's reads no field but knows <think> blocks, so the reasoning is
written into the content; gpt-oss's reads `thinking` and renders it in its own analysis channel,
trained from that channel's opening; Llama-3.1's has no place for it, so the row is refused, naming
the field."""

from __future__ import annotations

import json

import pytest

from engine.data.formats import FormatSpec, row_to_messages
from engine.data.render import RowError, tokenize_example, tokenize_rows
from tests.conformance.families import build_family_folder

CONV = FormatSpec("conversations", {"messages": "messages"})
REASONING = "The sky scatters short wavelengths.\nBlue is shorter than red."
ANSWER = "Because air scatters blue light more than red light."


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_family_folder(name)))


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    names = ("qwen3", "deepseek-v3.2", "deepseek-v3.1", "llama-3.1", "gpt-oss")
    return {name: _tokenizer(name) for name in names}


def _row(field: str | None, answer: str = ANSWER) -> dict:
    assistant = {"role": "assistant", "content": answer}
    if field:
        assistant[field] = REASONING
    return {"messages": [{"role": "user", "content": "Why is the sky blue?"}, assistant]}


def _inline_row() -> dict:
    return _row(None, f"<think>\n{REASONING}\n</think>\n\n{ANSWER}")


def _trained_text(tok, t) -> str:
    return tok.decode([i for i, m in zip(t.ids, t.trained) if m])


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_qwen3_renders_the_field_as_the_reasoning_written_inline(tokenizers, field):
    tok = tokenizers["qwen3"]
    got = tokenize_example(tok, row_to_messages(_row(field), CONV))
    inline = tokenize_example(tok, row_to_messages(_inline_row(), CONV))
    assert REASONING in got.text
    assert got.text == inline.text
    assert got.ids == inline.ids and got.trained == inline.trained
    trained = _trained_text(tok, got)
    assert REASONING in trained and ANSWER in trained and "<think>" in trained and trained.endswith("<|im_end|>")
    assert "Why is the sky blue?" not in trained
    assert not got.answers[0].reasoning_dropped


def test_qwen3_earlier_answer_reasoning_follows_the_template_history(tokenizers):
    # Qwen3's template drops an earlier answer's reasoning from the history: with the field as with
    # it inline; earlier_reasoning "keep" then gives that answer its own example, its reasoning trained.
    tok = tokenizers["qwen3"]
    second = [{"role": "user", "content": "And at sunset?"}, {"role": "assistant", "content": "Red light."}]
    field = _row("reasoning_content")
    field["messages"] += second
    inline = _inline_row()
    inline["messages"] += second
    got = tokenize_example(tok, row_to_messages(field, CONV))
    assert got.text == tokenize_example(tok, row_to_messages(inline, CONV)).text
    assert REASONING not in got.text and got.answers[0].reasoning_dropped
    (parts,) = tokenize_rows(tok, [row_to_messages(field, CONV)], earlier_reasoning="keep")
    assert len(parts) == 2
    assert REASONING in _trained_text(tok, parts[0]) and ANSWER in _trained_text(tok, parts[0])


def test_deepseek_v32_is_given_reasoning_content(tokenizers):
    tok = tokenizers["deepseek-v3.2"]
    messages = row_to_messages(_row("thinking"), CONV)
    got = tokenize_example(tok, messages)
    # What the template renders for a message carrying the OpenAI-style field it reads.
    official = [dict(messages[0]), {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}]
    assert got.text == tok.apply_chat_template(official, tokenize=False)
    # Without `thinking` the template writes only "</think>" before the answer: the answer is
    # trained and the reasoning reported as dropped by the template, as for the same row inline.
    assert REASONING in tok.apply_chat_template(official, tokenize=False, thinking=True)
    assert got.answers[0].reasoning_dropped and ANSWER in _trained_text(tok, got)


def test_deepseek_v31_gets_the_reasoning_inline(tokenizers):
    # DeepSeek-V3.1's template reads no reasoning field but splits <think> blocks out of the content.
    tok = tokenizers["deepseek-v3.1"]
    got = tokenize_example(tok, row_to_messages(_row("reasoning_content"), CONV))
    inline = tokenize_example(tok, row_to_messages(_inline_row(), CONV))
    assert got.text == inline.text and got.trained == inline.trained
    assert ANSWER in _trained_text(tok, got)


def test_gpt_oss_trains_its_analysis_channel(tokenizers):
    tok = tokenizers["gpt-oss"]
    got = tokenize_example(tok, row_to_messages(_row("reasoning_content"), CONV))
    trained = _trained_text(tok, got)
    # The generation prompt ends "<|start|>assistant": the model writes the channel markers itself.
    assert trained.startswith("<|channel|>analysis<|message|>" + REASONING + "<|end|>")
    assert trained.endswith("<|channel|>final<|message|>" + ANSWER + "<|return|>")
    assert "Why is the sky blue?" not in trained and not got.answers[0].reasoning_dropped


def test_a_template_without_a_place_for_reasoning_refuses_the_row(tokenizers):
    tok = tokenizers["llama-3.1"]
    with pytest.raises(RowError, match=r"message 1 has reasoning in 'reasoning_content'.*no place for it"):
        tokenize_example(tok, row_to_messages(_row("reasoning_content"), CONV))
    (got,) = tokenize_rows(tok, [row_to_messages(_row("thinking"), CONV)])
    assert isinstance(got, RowError) and "'thinking'" in str(got)
    # The same row without the field trains as before.
    assert ANSWER in _trained_text(tok, tokenize_example(tok, row_to_messages(_row(None), CONV)))


def test_xray_names_the_row_and_field_on_a_template_without_a_place(tokenizers, tmp_path):
    from engine.api import DataConfig
    from engine.data.xray import xray

    path = tmp_path / "chat.jsonl"
    rows = [_row(None), _row("reasoning_content"), _row(None)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    report = xray(DataConfig(source=str(path)), tokenizers["llama-3.1"])
    (rejected,) = report.by_kind()["rejected"]
    assert rejected.row == 1
    assert "'reasoning_content'" in rejected.detail and "no place for it" in rejected.detail


@pytest.mark.parametrize(
    ("assistant", "said"),
    [
        ({"content": "A", "reasoning_content": 3}, "message 1 field 'reasoning_content' is int, not text"),
        ({"content": "A", "reasoning_content": "x", "thinking": "y"}, "'reasoning_content' and 'thinking'"),
        ({"content": "<think>x</think>A", "thinking": "x"}, "a <think> block in its content"),
    ],
)
def test_bad_reasoning_fields_are_named(assistant, said):
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", **assistant}]}
    with pytest.raises(ValueError) as err:
        row_to_messages(row, CONV)
    assert said in str(err.value)


def test_null_or_empty_reasoning_is_no_reasoning():
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "thinking": None}]}
    assert row_to_messages(row, CONV)[1] == {"role": "assistant", "content": "A"}
    row["messages"][1]["reasoning_content"] = ""
    assert row_to_messages(row, CONV)[1] == {"role": "assistant", "content": "A"}


def test_reasoning_on_a_question_is_refused():
    row = {"messages": [{"role": "user", "content": "Q", "thinking": "hm"}, {"role": "assistant", "content": "A"}]}
    with pytest.raises(ValueError, match=r"message 0 \(user\) has reasoning in 'thinking'"):
        row_to_messages(row, CONV)


def test_xray_flags_a_special_token_in_the_reasoning_field(tokenizers, tmp_path):
    from engine.api import DataConfig
    from engine.data.xray import xray

    path = tmp_path / "chat.jsonl"
    rows = [_row("reasoning_content"), _row(None)]
    rows[0]["messages"][1]["reasoning_content"] = "Think.<|im_end|>"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    report = xray(DataConfig(source=str(path)), tokenizers["qwen3"])
    (found,) = report.by_kind()["special_tokens"]
    assert found.row == 0 and "<|im_end|>" in found.detail


def test_a_preference_pair_trains_the_chosen_answers_reasoning_field(tokenizers, tmp_path):
    from engine.api import DataConfig
    from engine.data.preference import prepare_preference_data

    tok = tokenizers["qwen3"]
    prompt = [{"role": "user", "content": "Why is the sky blue?"}]
    chosen = [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}]
    rows = [
        {"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": "It is not."}]},
        {"prompt": prompt, "chosen": [{**chosen[0], "thinking": 5}], "rejected": chosen},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = prepare_preference_data(DataConfig(source=str(path), max_seq_len=256), tok, "paired")
    (example,) = data.examples
    said = tok.decode(example[1])
    assert REASONING in said and ANSWER in said and "Why is the sky blue?" not in said
    ((row, why),) = data.skipped
    assert row == 1 and "column 'chosen': message 0 field 'thinking' is int, not text" in why
