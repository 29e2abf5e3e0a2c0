"""Data: sources, format detection, rendering with masks, packing, and bad input messages."""

import json

import pandas as pd
import pytest

from engine.config import DataConfig
from engine.data.collate import IGNORE_INDEX, PackedBatch
from engine.data.dataset import prepare_dataset
from engine.data.formats import detect_format, row_to_messages
from engine.data.packing import pack_best_fit_decreasing
from engine.data.render import tokenize_example
from engine.data.sources import DataError, load_raw


@pytest.fixture(scope="module")
def tokenizer():
    from engine.config import ModelConfig
    from engine.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig())


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_demo_set_detects_instruction_format(tokenizer):
    data = prepare_dataset(DataConfig(), tokenizer)
    s = data.summary()
    assert s["examples"] >= 300 and s["skipped"] == 0
    assert data.spec.kind == "instruction"
    assert 0.8 < s["packing_efficiency"] <= 1.0


def test_sharegpt_openai_and_text_shapes():
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    spec = detect_format(["conversations"])
    assert spec.kind == "conversations"
    assert row_to_messages(share, spec)[1] == {"role": "assistant", "content": "hello"}
    spec = detect_format(["messages", "id"])
    msgs = row_to_messages(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, spec
    )
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert detect_format(["text"]).kind == "text"
    assert detect_format(["question", "answer"]).mapping == {"instruction": "question", "output": "answer"}


def test_column_mapping_and_unknown_shape():
    with pytest.raises(DataError, match="match no known shape"):
        detect_format(["foo", "bar"])
    spec = detect_format(["foo", "bar"], mapping={"instruction": "foo", "output": "bar"})
    assert spec.kind == "instruction"
    with pytest.raises(DataError, match="data.columns.output"):
        detect_format(["foo"], mapping={"instruction": "foo", "output": "nope"})


def test_response_only_mask(tokenizer):
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "Answer: 5"}]
    tok = tokenize_example(tokenizer, msgs, responses_only=True)
    trained_text = tokenizer.decode([i for i, t in zip(tok.ids, tok.trained) if t])
    assert trained_text.startswith("Answer: 5")
    assert "plus" not in trained_text
    assert all(tokenize_example(tokenizer, msgs, responses_only=False).trained)


def test_trl_conversational_prompt_completion_rows(tmp_path, tokenizer):
    """TRL's conversational prompt-completion format: the prompt a list of messages, the completion a list
    of messages (or an answer's text). It was refused row by row ("column 'prompt' is list, not text")."""
    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}],
            "completion": [{"role": "assistant", "content": f"Answer: {i + 1}"}] if i % 2 else f"Answer: {i + 1}",
        }
        for i in range(6)
    ]
    data = prepare_dataset(DataConfig(source=str(write_jsonl(tmp_path / "pc.jsonl", rows))), tokenizer)
    assert data.spec.kind == "instruction" and data.summary()["examples"] == 6 and not data.skipped
    for i, (ids, trained) in enumerate(zip(data.docs, data.trained)):
        assert tokenizer.decode([t for t, on in zip(ids, trained) if on]).startswith(f"Answer: {i + 1}")
    spec = detect_format(["prompt", "completion"])
    bad = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "again"}]}
    with pytest.raises(ValueError, match="column 'completion' does not end with an assistant message"):
        row_to_messages(bad, spec)


def test_a_system_column_beside_a_conversation_is_its_system_prompt():
    """ShareGPT exports with a "system" column: it was dropped without a word."""
    spec = detect_format(["conversations", "system"])
    assert spec.mapping == {"messages": "conversations", "system": "system"}
    row = {"system": "Be brief.", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert row_to_messages(row, spec)[0] == {"role": "system", "content": "Be brief."}
    own = {"system": "Be brief.", "conversations": [{"from": "system", "value": "Be kind."}, *row["conversations"]]}
    assert [m["content"] for m in row_to_messages(own, spec)] == ["Be kind.", "hi", "yo"]  # its own one wins


def test_tool_calls_and_tools_are_kept_for_the_template(tokenizer):
    """OpenAI's fine-tuning rows: an assistant message that calls a tool (tool_calls, no content), the
    tool's result, and the tool definitions in a "tools" column (JSON text). The call was dropped,
    training the conversation around an empty answer. Now the call reaches the template, its arguments
    parsed from JSON text (templates write them with tojson); a template with no place for calls (the
    demo's ChatML) refuses the row in one sentence rather than train it without the call."""
    from engine.data.formats import TOOLS_FIELD
    from engine.data.render import RowError

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call1", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "tools": json.dumps(tools),
    }
    spec = detect_format(["messages", "tools"])
    assert spec.mapping == {"messages": "messages", "tools": "tools"}
    messages = row_to_messages(row, spec)
    assert messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "call1"}
    ]
    assert (
        messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call1" and messages[2]["name"] == "get_weather"
    )
    assert all(m[TOOLS_FIELD] == tools for m in messages)
    with pytest.raises(RowError, match=r"this chat template does not write tool calls \(the call to get_weather"):
        tokenize_example(tokenizer, messages)
    legacy = {"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": "{}"}}
    assert row_to_messages({"messages": [row["messages"][0], legacy]}, detect_format(["messages"]))[1][
        "tool_calls"
    ] == [{"type": "function", "function": {"name": "get_weather", "arguments": {}}}]
    with pytest.raises(ValueError, match="column 'tools' is not JSON"):
        row_to_messages({**row, "tools": "[{"}, spec)


def test_malformed_jsonl_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "broken"\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2: malformed JSON"):
        load_raw(DataConfig(source=str(p)))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_raw(DataConfig(source=str(tmp_path / "nope.jsonl")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_raw(DataConfig(source=str(empty)))
    with pytest.raises(DataError, match="unsupported file type"):
        (tmp_path / "x.txt").write_text("hi")
        load_raw(DataConfig(source=str(tmp_path / "x.txt")))


def test_csv_and_parquet(tmp_path, tokenizer):
    df = pd.DataFrame({"prompt": ["a b", "c d"], "response": ["Answer: 1", "Answer: 2"]})
    df.to_csv(tmp_path / "d.csv", index=False)
    df.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        data = prepare_dataset(DataConfig(source=str(tmp_path / name), max_seq_len=64), tokenizer)
        assert len(data.docs) == 2


def test_unusable_rows_are_skipped_with_reasons(tmp_path, tokenizer):
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"instruction": "q1", "output": "Answer: 1"},
            {"instruction": "q2", "output": ""},
            {"instruction": 5, "output": "x"},
        ],
    )
    data = prepare_dataset(DataConfig(source=str(p), max_seq_len=64), tokenizer)
    assert len(data.docs) == 1
    reasons = dict(data.skipped)
    assert "empty" in reasons[1] and "int" in reasons[2]


def test_all_rows_unusable_is_an_error(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "output": ""}])
    with pytest.raises(DataError, match="no usable examples.*row 1\\)"):
        prepare_dataset(DataConfig(source=str(p), max_seq_len=64), tokenizer)


def test_overlong_examples_truncated_or_dropped(tmp_path, tokenizer):
    long = " ".join(["apple"] * 200)
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"instruction": "short", "output": "Answer: 1"},
            {"instruction": "long", "output": long},
        ],
    )
    cut = prepare_dataset(DataConfig(source=str(p), max_seq_len=32), tokenizer)
    assert cut.truncated == 1 and len(cut.docs) == 2 and max(map(len, cut.docs)) == 32
    drop = prepare_dataset(DataConfig(source=str(p), max_seq_len=32, overlong="drop"), tokenizer)
    assert drop.dropped_overlong == 1 and len(drop.docs) == 1
    assert "longer than a row" in drop.skipped[0][1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_decreasing_packs_every_doc_once(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    res = pack_best_fit_decreasing(lengths, 128)
    placed = sorted(i for row in res.rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 128 for row in res.rows)
    # No two rows could be merged: best fit leaves few half-empty rows.
    assert res.efficiency > 0.9
    with pytest.raises(ValueError):
        pack_best_fit_decreasing([129], 128)


def test_packed_batch_targets_never_cross_documents():
    batch = PackedBatch.from_documents([[1, 2, 3], [4, 5], [6]], [[False, True, True], [True, True], [True]])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert batch.targets.tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.num_trained_tokens == 3
    assert batch.info.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert batch.info.position_ids.tolist() == [0, 1, 2, 0, 1, 0]


def test_unreachable_hub_data_set_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="Hugging Face Hub"):
        load_raw(DataConfig(source="someone/dataset-that-is-not-cached"))


def test_preview_shows_rows_example_and_packing(tmp_path, tokenizer):
    from engine.data import preview

    cfg = DataConfig()
    p = preview.load_preview(cfg)
    assert p.num_rows > 300 and p.format.kind == "instruction" and not p.problems
    assert set(p.row(0)) == {"instruction", "input", "output"}
    ex = preview.render_example(tokenizer, cfg, 0)
    trained = "".join(t for t, on in ex.pieces if on)
    assert trained.startswith("Answer:") and ex.n_trained < ex.n_tokens
    lay = preview.packing_layout(tokenizer, cfg)
    assert sum(map(len, lay.rows)) == lay.examples == p.num_rows
    assert all(sum(r) <= lay.row_tokens for r in lay.rows) and lay.efficiency > 0.8

    bad = write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, {"a": 2}])
    p = preview.load_preview(DataConfig(source=str(bad)))
    assert p.format is None and "match no known shape" in p.error and p.num_rows == 2
