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
    # The duplicate names the row it repeats as a person reads it (from 1: index 0 is row 1).
    assert "row 1" in by["duplicate"][0].detail and "unknown role 'wizard'" in by["roles"][1].detail
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


# -- preference pairs (issue 30): their own findings, through the X-ray the Data page runs -----------
def test_preference_pairs_get_their_findings_through_the_xray_scan(tmp_path, tok):
    from engine.api import DATA_FINDINGS, xray_scan

    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    bot = lambda t: {"role": "assistant", "content": t}  # noqa: E731
    rows = [
        {"prompt": "What is 7 plus 5?", "chosen": "Answer: 12", "rejected": "Answer: 13"},  # 0: clean
        {"prompt": "What is 2 plus 2?", "chosen": "Answer: 4", "rejected": "Answer: 4"},  # 1: identical
        {"prompt": "What is 3 plus 3?", "chosen": "Answer: 6", "rejected": ""},  # 2: empty side
        {"prompt": "Tell a story.", "chosen": "Once upon a time " * 40, "rejected": "No."},  # 3: chosen cut
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # TRL's implicit-prompt conversations: row 1's user turn differs between the sides.
    conv = tmp_path / "conv.jsonl"
    peru, chile = user("Capital of Peru?"), user("Capital of Chile?")
    conv.write_text(
        json.dumps({"chosen": [peru, bot("Lima")], "rejected": [peru, bot("Quito")]})
        + "\n"
        + json.dumps({"chosen": [peru, bot("Lima")], "rejected": [chile, bot("Lima")]})
        + "\n"
    )
    x = xray_scan(RunConfig.from_dict({"data": {"source": str(pairs), "max_seq_len": 96}}).data, tok)
    found = {(f.kind, f.row) for f in x.findings}
    assert found == {("identical_sides", 1), ("empty_side", 2), ("side_truncated", 3)}, x.findings
    (cut,) = x.by_kind()["side_truncated"]
    assert cut.detail.startswith("chosen keeps ") and "rejected" not in cut.detail
    assert x.rows == 4 and len(x.lengths) == 3 and x.over_limit() == 1  # row 3 is over max_seq_len
    assert {"identical_sides", "empty_side", "side_truncated", "prompt_differs"} <= DATA_FINDINGS.keys()

    x = xray_scan(RunConfig.from_dict({"data": {"source": str(conv)}}).data, tok)
    assert [(f.kind, f.row) for f in x.findings] == [("prompt_differs", 1)], x.findings
    assert "message 0" in x.findings[0].detail
