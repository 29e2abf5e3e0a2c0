"""The X-ray's fast paths (issue 28) give what the one-row path gives: engine.data.render's
tokenize_examples (conversations rendered in one call, every text tokenized in one fast-tokenizer
call, trained flags by numpy) against a row-at-a-time reference written here the way render.py did
it before (apply_chat_template, the tokenizer on one text, the per-token overlap test in Python), on
every conformance family; the X-ray in batches against the X-ray one row at a time; findings past
KEPT_PER_KIND counted, not kept."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.api import RunConfig, load_tokenizer
from engine.data import scan, xray
from engine.data.render import RowError, answer_spans, render, tokenize_example, tokenize_examples, trained_spans
from tests.conformance.conversations import CONVERSATIONS
from tests.conformance.families import FAMILIES

# Rows like a big chat file's, beside the corpus: a system prompt, several exchanges, a long answer.
EXTRA = [
    [
        {"role": "system", "content": "You are a careful tutor."},
        {"role": "user", "content": "What is 7 plus 5?"},
        {"role": "assistant", "content": "Seven plus five is twelve. " * 30},
        {"role": "user", "content": "And 2 plus 2?"},
        {"role": "assistant", "content": "Four."},
    ],
    [{"role": "user", "content": "Say OK"}, {"role": "assistant", "content": "OK"}],
    "a plain text row, trained whole",
]


def one_row(tok, example, responses_only=True, fold_system=False, final_only=False, added_end=None):
    """The reference: (ids, trained, text) of one row, or the RowError's message. `added_end`: the
    end-of-turn token a family's template leaves off its last answer (Family.last_end_added), which
    training puts after it."""
    if isinstance(example, str):
        ids = tok(example, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids, [True] * len(ids), example
    try:
        text, rendered, _ = render(tok, example, fold_system)
        # A template with {% generation %} blocks marks the answers itself (render.trained_spans).
        spans = trained_spans(tok, example, fold_system)[1] if "generation" in tok.chat_template else None
        spans = answer_spans(tok, rendered, text) if spans is None else spans
    except RowError as exc:
        return str(exc)
    if added_end and spans and spans[-1].end == len(text):
        text += added_end
        spans[-1] = dataclasses.replace(spans[-1], end=len(text), ends_at_marker=True, end_added=True)
    spans = spans[-1:] if final_only else spans
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if not responses_only:
        return enc["input_ids"], [True] * len(enc["input_ids"]), text
    trained = [e > s and any(s < sp.end and e > sp.start for sp in spans) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], trained, text


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_batched_rows_are_the_one_row_reference(name, family_tokenizer):
    tok = family_tokenizer(name)
    examples = [list(m) for m in CONVERSATIONS.values()] + EXTRA  # rows the template rejects too
    for responses_only, fold, reasoning in [
        (True, False, "drop"),
        (True, True, "final_turn_only"),
        (False, False, "drop"),
    ]:
        got = tokenize_examples(tok, examples, responses_only, fold, reasoning)
        rejected = 0
        for example, g in zip(examples, got):
            fam = FAMILIES[name]
            added = fam.end_marker if fam.last_end_added else None
            want = one_row(tok, example, responses_only, fold, reasoning == "final_turn_only", added)
            if isinstance(want, str):
                rejected += 1
                assert isinstance(g, RowError) and str(g) == want, (name, example)
                continue
            assert (g.ids, g.trained, g.text) == want, (name, example)
            one = tokenize_example(tok, example, responses_only, fold, reasoning)  # a batch of one
            assert (one.ids, one.trained, one.answers, one.folded_system) == (
                g.ids,
                g.trained,
                g.answers,
                g.folded_system,
            )
        assert rejected < len(examples)
        if responses_only:  # the masks compared are masks: some tokens trained, some not
            assert any(any(g.trained) and not all(g.trained) for g in got if not isinstance(g, RowError))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def _mixed_rows():
    rows = [{"messages": m} for m in CONVERSATIONS.values()]
    rows += [
        _chat(("user", "hi"), ("assistant", "hello")),
        _chat(("user", "hi"), ("assistant", "hello")),  # duplicate
        _chat(("assistant", "first"), ("user", "x"), ("assistant", "y")),  # roles
        _chat(("user", "a <|im_end|> b"), ("assistant", "ok <|eot_id|>")),  # special tokens
        _chat(("user", "q"), ("assistant", "word " * 300)),  # cut at max_seq_len
        _chat(("wizard", "q"), ("assistant", "x")),  # unknown role
        _chat(("user", "q " * 300), ("assistant", "x")),  # the cut removes the answer
        _chat(("user", "only a question")),  # unreadable: nothing to train
    ]
    return rows * 2  # every row again: duplicates of earlier batches too


@pytest.mark.parametrize("name", ["qwen3", "gemma-2", "mistral-v0.2", "gpt-oss"])
def test_xray_in_batches_is_the_xray_row_by_row(name, family_folder, tmp_path, monkeypatch):
    tok = load_tokenizer(RunConfig.from_dict({"model": {"name_or_path": str(family_folder(name))}}).model)
    source = _write(tmp_path / "mixed.jsonl", _mixed_rows())
    cfg = RunConfig.from_dict({"data": {"source": source, "max_seq_len": 128}}).data
    batched = xray.xray(cfg, tok)
    monkeypatch.setattr(scan, "BATCH", 1)  # one row per render and tokenizer call
    single = xray.xray(cfg, tok)
    assert [(f.kind, f.row, f.detail) for f in batched.findings] == [(f.kind, f.row, f.detail) for f in single.findings]
    assert list(batched.lengths) == list(single.lengths) and batched.counts() == single.counts()
    kinds = {k for k, n in batched.counts().items() if n}
    assert {"duplicate", "roles", "truncated_answer", "fully_masked", "unreadable"} <= kinds, kinds


def test_findings_past_the_kept_number_are_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(xray, "KEPT_PER_KIND", 3)
    rows = [_chat(("user", "same"), ("assistant", "same"))] * 10 + [_chat(("assistant", "first"))] * 2
    source = _write(tmp_path / "dups.jsonl", rows)
    tok = load_tokenizer(RunConfig().model)
    x = xray.xray(RunConfig.from_dict({"data": {"source": source}}).data, tok)
    # Rows 1-9 repeat row 0, row 11 repeats row 10 (which opens with the assistant: roles).
    assert x.counts()["duplicate"] == 10 and [f.row for f in x.by_kind()["duplicate"]] == [1, 2, 3]
    assert x.more == {"duplicate": 7} and x.counts()["roles"] == 2
    assert len(x.lengths) == 12 and x.rows == 12
