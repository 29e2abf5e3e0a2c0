"""Masks right by construction, on every family of the conformance suite: the trained tokens of a
conversation are exactly each assistant answer as the template renders it plus its end-of-turn
token, never any of the next turn and never the system prompt or a question."""

from __future__ import annotations

import pytest

from engine.data.render import tokenize_example
from tests.conformance.families import FAMILIES, conversations_for


def trained_runs(text: str, offsets, trained) -> list[str]:
    """The rendered text under each run of consecutive trained tokens."""
    runs, start, end = [], None, None
    for (s, e), t in zip(offsets, trained):
        if t:
            start = s if start is None else start
            end = e
        elif start is not None:
            runs.append(text[start:end])
            start = None
    if start is not None:
        runs.append(text[start:end])
    return runs


def expected_answers(fam, messages: list[dict], text: str) -> list[str]:
    """Each answer as the template renders it (a template that drops the reasoning of an answer
    renders what follows its </think>) and the end-of-turn token after it."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    out = []
    for i, content in enumerate(answers):
        shown = content if content in text else content.split("</think>")[-1].strip()
        out.append(shown + fam.end_of(last=i == len(answers) - 1))
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_trained_tokens_are_each_answer_and_its_end_token(name, family_tokenizer):
    fam, tok = FAMILIES[name], family_tokenizer(name)
    for conv, messages in conversations_for(name).items():
        text = tok.apply_chat_template(messages, tokenize=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        got = tokenize_example(tok, messages, responses_only=True)
        assert got.ids == enc["input_ids"], f"{name}/{conv}: the training ids are not the rendered text's"
        runs = trained_runs(text, enc["offset_mapping"], got.trained)
        # A sentencepiece word token carries the blank before it ("▁Hi"): whitespace at a run's
        # edges is the only slack.
        assert [r.strip() for r in runs] == [e.strip() for e in expected_answers(fam, messages, text)], (
            f"{name}/{conv}: trained text differs from the answers + end tokens\n{text!r}"
        )
