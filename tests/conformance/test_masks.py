"""Masks right by construction, on every family of the conformance suite: the trained tokens of a
conversation are exactly each assistant answer as the template renders it plus its end-of-turn
token, never any of the next turn and never the system prompt or a question."""

from __future__ import annotations

import re

import pytest

from engine.data.render import tokenize_example
from tests.conformance.families import FAMILIES, conversations_for


def trained_runs(offsets, trained) -> list[tuple[int, int, int]]:
    """(start, end, end of the first token) in characters of each run of consecutive trained tokens."""
    runs, run = [], None
    for (s, e), t in zip(offsets, trained):
        if t:
            run = [s, e, e] if run is None else [run[0], e, run[2]]
        elif run is not None:
            runs.append(tuple(run))
            run = None
    if run is not None:
        runs.append(tuple(run))
    return runs


def check_run(text: str, run: tuple[int, int, int], expected: str) -> bool:
    """The run is the expected answer + end token, give or take its first token: a token may carry
    a character before the answer (sentencepiece's "▁Hi"; "]```" after Mistral's "[/INST]")."""
    start, end, first_end = run
    got = text[start:end]
    if not got.endswith(expected):
        return False
    lead = len(got) - len(expected)
    return lead == 0 or not text[start : start + lead].strip() or start + lead < first_end


def as_rendered(content: str, text: str) -> str:
    """An answer as the template renders it: as written; or its reasoning in the template's own
    spacing, from the opening <think> (GLM's "<think>r</think>\nanswer", StepFun's one newline);
    or, a template that drops the reasoning of an answer, what follows its </think>."""
    if content in text:
        return content
    reasoning, _, final = content.rpartition("</think>")
    reasoning, final = reasoning.replace("<think>", "").strip(), final.strip()
    pattern = r"<think>\s*" + re.escape(reasoning) + r"\s*</think>\s*" + re.escape(final)
    found = re.search(pattern, text) if reasoning else None
    return found.group(0) if found else final


def expected_answers(fam, messages: list[dict], text: str) -> list[str]:
    """Each answer as the template renders it (as_rendered) and the end-of-turn token after it."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return [as_rendered(c, text) + fam.end_of(last=i == len(answers) - 1) for i, c in enumerate(answers)]


def training_text(fam, tok, messages: list[dict]) -> str:
    """The conversation as training tokenizes it: the render, and for a family whose template leaves
    the last answer without its end-of-turn token (Family.last_end_added), that token after it."""
    text = tok.apply_chat_template(messages, tokenize=False)
    return text + fam.end_marker if fam.last_end_added else text


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_trained_tokens_are_each_answer_and_its_end_token(name, family_tokenizer):
    fam, tok = FAMILIES[name], family_tokenizer(name)
    for conv, messages in conversations_for(name).items():
        text = training_text(fam, tok, messages)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        got = tokenize_example(tok, messages, responses_only=True)
        assert got.ids == enc["input_ids"], f"{name}/{conv}: the training ids are not the rendered text's"
        runs = trained_runs(enc["offset_mapping"], got.trained)
        expected = expected_answers(fam, messages, text)
        shown = [text[a:b] for a, b, _ in runs]
        assert len(runs) == len(expected) and all(check_run(text, r, e) for r, e in zip(runs, expected)), (
            f"{name}/{conv}: trained {shown}, expected {expected}\n{text!r}"
        )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_xray_finds_every_answer_ended_on_real_templates(tmp_path, name, family_tokenizer):
    """The corpus is clean for every family: no answer without its end-of-turn token, no row the
    template rejects (the family's conversations_for are the ones its template accepts)."""
    import json

    from engine.config import DataConfig
    from engine.data.xray import xray

    tok = family_tokenizer(name)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations_for(name).values()))
    x = xray(DataConfig(source=str(path), max_seq_len=1024), tok)
    bad = [f for f in x.findings if f.kind in ("missing_eos", "answer_end", "rejected", "unreadable", "fully_masked")]
    assert bad == [], bad
