"""engine.data.render on hand-made templates of the shapes the upstream families do not show:
`{% generation %}` blocks, and an answer with no end-of-turn token after it (the X-ray says so)."""

from __future__ import annotations

import json

import pytest

from engine.api import RunConfig, load_tokenizer
from engine.data.render import RowError, tokenize_example
from engine.data.xray import xray


@pytest.fixture()
def tok():
    return load_tokenizer(RunConfig().model)  # the bundled demo model's tokenizer (ChatML markers)


CHAT = [
    {"role": "user", "content": "Question one?"},
    {"role": "assistant", "content": "Answer one."},
    {"role": "user", "content": "Question two?"},
    {"role": "assistant", "content": "Answer two."},
]


def trained_text(tok, t):
    return tok.decode([i for i, m in zip(t.ids, t.trained) if m])


def test_generation_blocks_say_what_is_trained(tok):
    # The block holds the answer but not its end marker: what the template marks is what trains.
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    )
    t = tokenize_example(tok, CHAT)
    assert trained_text(tok, t) == "Answer one.Answer two."
    assert [a.ends_at_marker for a in t.answers] == [False, False]


def test_answer_without_end_token_between_turns_is_an_xray_finding(tmp_path, tok):
    # Earlier answers run straight into the next question; only the last gets <|im_end|>.
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
        "{% if loop.last %}{{ '<|im_end|>' }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    )
    t = tokenize_example(tok, CHAT)
    assert trained_text(tok, t) == "Answer one.Answer two.<|im_end|>"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    x = xray(RunConfig.from_dict({"data": {"source": str(path)}}).data, tok)
    assert [(f.kind, f.row) for f in x.findings] == [("answer_end", 0)]
    assert "answer 1 ends with" in x.findings[0].detail


def test_a_template_that_rewrites_an_answer_is_a_row_error(tok):
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper + '\\n' }}{% endfor %}"
    with pytest.raises(RowError, match="answer 1 is not in the rendered conversation"):
        tokenize_example(tok, CHAT)
