"""Training data is tokenized in batches (engine.data.dataset.prepare_dataset over
engine.data.render.tokenize_rows, the X-ray's tokenize_examples underneath): the same token ids,
trained masks, row errors with their row numbers, truncations and notes as the one-row-at-a-time
path it replaced (written out here as the reference), on the demo data and on real upstream
templates (Gemma-2 rejecting system rows, Qwen3 dropping earlier reasoning), across batch bounds."""

from __future__ import annotations

import json

import pytest

from engine.config import DataConfig
from engine.data import render
from engine.data.dataset import prepare_dataset
from engine.data.formats import detect_format, row_to_messages
from engine.data.render import ensure_chat_template, tokenize_example
from engine.data.scan import BATCH
from engine.data.sources import DataError, load_raw
from tests.conformance.conversations import CONVERSATIONS


def one_row_at_a_time(cfg: DataConfig, tok):
    """The reference: prepare_dataset's loop before batching, one row through the tokenizer at a time."""
    raw = load_raw(cfg)
    spec = detect_format(list(raw.column_names), cfg.format, cfg.columns, cfg.source)
    if spec.kind != "text":
        ensure_chat_template(tok)
    docs, masks, skipped = [], [], []
    truncated = dropped = reasoning = 0
    args = (cfg.train_on_responses_only, cfg.fold_system_message)
    for i, row in enumerate(raw):
        try:
            example = row_to_messages(row, spec)
            whole = tokenize_example(tok, example, *args, cfg.earlier_reasoning)
            toks = [whole]
            if cfg.earlier_reasoning == "keep" and any(a.reasoning_dropped for a in whole.answers):
                toks = [
                    tokenize_example(tok, example[: k + 1], *args, "final_turn_only")
                    for k, m in enumerate(example)
                    if m["role"] == "assistant"
                ]
        except ValueError as exc:
            skipped.append((i, str(exc)))
            continue
        reasoning += any(a.reasoning_dropped for t in toks for a in t.answers)
        for t in toks:
            ids, trained = t.ids, t.trained
            if len(ids) > cfg.max_seq_len:
                if cfg.overlong == "drop":
                    dropped += 1
                    skipped.append((i, f"{len(ids)} tokens, longer than a row ({cfg.max_seq_len}); dropped"))
                    continue
                ids, trained = ids[: cfg.max_seq_len], trained[: cfg.max_seq_len]
                truncated += 1
            if sum(trained[1:]) == 0:
                cut = (
                    f"the cut at data.max_seq_len ({cfg.max_seq_len} tokens) removed every answer token "
                    "(the prompt is longer; raise data.max_seq_len)"
                )
                skipped.append((i, cut if any(t.trained[1:]) else "no trained tokens (nothing to learn from this row)"))
                continue
            docs.append(ids)
            masks.append(trained)
    return docs, masks, skipped, truncated, dropped, reasoning


def assert_same(cfg: DataConfig, tok):
    docs, masks, skipped, truncated, dropped, reasoning = one_row_at_a_time(cfg, tok)
    data = prepare_dataset(cfg, tok)
    assert data.docs == docs
    assert data.trained == masks
    assert data.skipped == skipped
    assert (data.truncated, data.dropped_overlong) == (truncated, dropped)
    assert bool(data.notes) == bool(reasoning) and (not reasoning or f"in {reasoning} row" in data.notes[0])
    return data


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def demo_tokenizer():
    from transformers import AutoTokenizer

    from engine.resources import DEMO_MODEL_DIR

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def family_tokenizer(name: str):
    from transformers import AutoTokenizer

    from tests.conformance.families import build_family_folder

    return AutoTokenizer.from_pretrained(build_family_folder(name))


@pytest.mark.parametrize(
    "options",
    [{}, {"train_on_responses_only": False}, {"max_seq_len": 26}, {"max_seq_len": 26, "overlong": "drop"}],
)
def test_demo_data_in_batches_is_the_one_row_path(options):
    data = assert_same(DataConfig(**options), demo_tokenizer())
    assert data.num_rows > BATCH  # the demo set spans more than one batch
    if "max_seq_len" in options:
        assert data.truncated or data.dropped_overlong


def _mixed_rows(n: int) -> list[dict]:
    """n rows cycling through the conformance conversations, with unreadable rows among them."""
    names = sorted(CONVERSATIONS)
    rows: list[dict] = []
    for i in range(n):
        if i % 97 == 13:
            rows.append({"messages": [{"role": "narrator", "content": "not a role"}]})
        elif i % 89 == 5:
            rows.append({"messages": "not a list"})
        else:
            rows.append({"messages": CONVERSATIONS[names[i % len(names)]]})
    return rows


@pytest.mark.parametrize(
    "family, options",
    [
        ("gemma-2", {}),  # system rows rejected, with their numbers and reasons
        ("gemma-2", {"fold_system_message": True, "max_seq_len": 64}),
        ("qwen3", {"earlier_reasoning": "keep"}),  # a row split into one example per answer
        ("qwen3", {"earlier_reasoning": "final_turn_only", "max_seq_len": 40, "overlong": "drop"}),
    ],
)
def test_a_conformance_family_in_batches_is_the_one_row_path(tmp_path, family, options):
    tok = family_tokenizer(family)
    cfg = DataConfig(source=write_rows(tmp_path / "mixed.jsonl", _mixed_rows(2 * BATCH + 31)), **options)
    data = assert_same(cfg, tok)
    assert data.skipped and data.docs
    assert any(i > BATCH for i, _ in data.skipped)  # errors past the first batch keep their own row numbers
    reasons = " ".join(r for _, r in data.skipped)
    assert "unknown role" in reasons or "narrator" in reasons
    if family == "gemma-2" and not options:
        assert "System role not supported" in reasons
    if options.get("earlier_reasoning") == "keep":
        assert len(data.docs) > data.num_rows - len({i for i, _ in data.skipped})  # some rows gave several


def test_every_row_rejected_still_says_why(tmp_path):
    tok = family_tokenizer("gemma-2")
    rows = [{"messages": CONVERSATIONS["system_single"]}] * (BATCH + 3)
    with pytest.raises(DataError, match=r"every row failed with: the chat template rejects this row.*\(first: row 1\)"):
        prepare_dataset(DataConfig(source=write_rows(tmp_path / "sys.jsonl", rows)), tok)


def test_the_tokenizer_is_called_once_per_batch_not_once_per_row(monkeypatch):
    """What batching is for: the fast tokenizer sees a batch of rows per call."""
    calls = []
    encode = render._encode

    def counting(tokenizer, texts, offsets):
        if texts:
            calls.append(len(texts))
        return encode(tokenizer, texts, offsets)

    monkeypatch.setattr(render, "_encode", counting)
    data = prepare_dataset(DataConfig(), demo_tokenizer())
    batches = -(-data.num_rows // BATCH)
    assert sum(calls) == data.num_rows and len(calls) <= batches, (len(calls), batches)
