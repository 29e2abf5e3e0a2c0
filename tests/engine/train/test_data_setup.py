"""The session's data step on its own (engine.train.data_setup): the tokenizer and the objective's
data from a real JSONL file, and what the log says about them, in order."""

import json

from engine.config import RunConfig
from engine.resources import DEMO_PRESET
from engine.train.data_setup import SKIPPED_SHOWN, data_notes, load_data
from engine.train.objectives import objective_for


def config_for(tmp_path, rows, max_seq_len=64):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.data.source = str(path)
    cfg.data.max_seq_len = max_seq_len
    return cfg


def good(n):
    return [{"instruction": f"Say {i}", "output": f"Answer: {i}"} for i in range(n)]


def test_load_data_reads_the_objectives_data_and_counts_the_held_out(tmp_path):
    cfg = config_for(tmp_path, good(30))
    logs = []
    loaded = load_data(cfg, objective_for(cfg), lambda message, level="info": logs.append((level, message)))
    assert logs == [("info", f"Loading tokenizer and data ({cfg.data.source})")]
    assert loaded.summary["examples"] == 30 and loaded.summary["rows_read"] == 30
    # 30 examples are too few for a held-out split: none, and the note says why.
    assert loaded.heldout is None and loaded.summary["eval_examples"] == 0
    assert "No held-out split" in loaded.heldout_note
    assert loaded.tokenizer("Say 1")["input_ids"]  # the model's own tokenizer
    assert len(loaded.data.packing.rows) == loaded.summary["packed_rows"]


def test_data_notes_name_skipped_rows_then_count_the_rest_and_end_with_the_packing(tmp_path):
    empty = [{"instruction": "", "output": ""} for _ in range(SKIPPED_SHOWN + 3)]
    long = [{"instruction": "long " * 200, "output": "Answer: long"}]
    cfg = config_for(tmp_path, good(30) + empty + long)
    loaded = load_data(cfg, objective_for(cfg), lambda *a: None)
    notes = data_notes(loaded, cfg.data.max_seq_len)
    levels = [level for _, level in notes]
    messages = [message for message, _ in notes]
    skipped = [m for m in messages if m.startswith("Row ")]
    # Rows count from 1 as the file's lines do: the first empty row is line 31.
    assert len(skipped) == SKIPPED_SHOWN and skipped[0] == "Row 31 skipped: column 'instruction' is empty"
    rest = len(loaded.data.skipped) - SKIPPED_SHOWN
    assert f"... and {rest} more rows skipped" in messages
    assert "1 example was longer than 64 tokens and was truncated" in messages
    assert messages[0] == loaded.heldout_note and levels[0] == "info"
    s = loaded.summary
    full = f"{s['packing_efficiency']:.1%}"
    assert messages[-1] == f"{s['examples']} examples packed into {s['packed_rows']} rows of 64 tokens ({full} full)"
    assert levels[-1] == "info" and set(levels[1:-1]) == {"warning"}


def test_clean_data_says_only_the_held_out_and_the_packing(tmp_path):
    cfg = config_for(tmp_path, good(12), max_seq_len=128)
    loaded = load_data(cfg, objective_for(cfg), lambda *a: None)
    notes = data_notes(loaded, cfg.data.max_seq_len)
    assert [level for _, level in notes] == ["info", "info"]
    assert notes[1][0].startswith("12 examples packed into ")
