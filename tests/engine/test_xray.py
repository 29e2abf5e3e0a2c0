"""Data X-ray (engine.data.xray) on the demo tokenizer: each kind of finding names its row."""

from __future__ import annotations

import json

import pytest

from engine.api import RunConfig, load_tokenizer
from engine.data.xray import KINDS, xray


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(RunConfig().model)  # the bundled demo model's tokenizer


def _chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_demo_data_is_clean(tok):
    x = xray(RunConfig.from_dict({"data": {"source": "demo"}}).data, tok)
    assert x.rows == len(x.lengths) > 100
    assert x.findings == []  # every demo answer ends with the template's end-of-turn token
    edges, counts = x.histogram(10)
    assert sum(counts) == x.rows and edges[-1] >= x.max_seq_len and x.over_limit() == 0


def test_each_finding_names_its_row(tmp_path, tok):
    rows = [
        _chat(("user", "hi"), ("assistant", "hello")),
        _chat(("user", "hi"), ("assistant", "hello")),  # 1: duplicate of 0
        _chat(("assistant", "first"), ("user", "x"), ("assistant", "y")),  # 2: opens with the assistant
        _chat(("user", "a <|im_end|> b"), ("assistant", "ok")),  # 3: a special token typed in
        _chat(("user", "q"), ("assistant", "word " * 400)),  # 4: answer cut at 256 tokens
        _chat(("wizard", "q"), ("assistant", "x")),  # 5: unknown role
        _chat(("user", "q " * 600), ("assistant", "x")),  # 6: the cut removes the whole answer
        _chat(("user", "a"), ("user", "b"), ("assistant", "c")),  # 7: two user turns in a row
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    x = xray(RunConfig.from_dict({"data": {"source": str(path), "max_seq_len": 256}}).data, tok)
    found = {(f.kind, f.row) for f in x.findings}
    assert found == {
        ("duplicate", 1),
        ("roles", 2),
        ("special_tokens", 3),
        ("truncated_answer", 4),
        ("roles", 5),
        ("fully_masked", 6),
        ("roles", 7),
    }, x.findings
    by = x.by_kind()
    assert "row 0" in by["duplicate"][0].detail and "unknown role 'wizard'" in by["roles"][1].detail
    assert set(by) == set(KINDS)
    assert x.over_limit() == 2 and len(x.lengths) == 7  # row 5 cannot be tokenized


def test_answer_without_end_marker_is_flagged(tmp_path, tok):
    # Plain text rows get the tokenizer's EOS appended; a template that drops the end marker
    # after the answer leaves the model nothing that teaches it to stop.
    tok = load_tokenizer(RunConfig().model)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}" + (
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(_chat(("user", "q"), ("assistant", "an answer"))) + "\n")
    x = xray(RunConfig.from_dict({"data": {"source": str(path)}}).data, tok)
    assert [(f.kind, f.row) for f in x.findings] == [("missing_eos", 0)]
    assert "answer" in x.findings[0].detail
