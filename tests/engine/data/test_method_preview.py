"""The data preview reads a file as the chosen method's data (issue 30): KTO's prompt/completion/
label and GRPO's prompt/answer are SFT-shaped too, so training.method decides; a prompts file
under SFT says why it cannot train; SFT rows under DPO say what DPO reads; a pair's example has
its sides, token for token what training packs. On the demo model's tokenizer."""

from __future__ import annotations

import json

import pytest

from engine.api import load_tokenizer
from engine.config import DataConfig, ModelConfig
from engine.data import preview
from engine.data.formats import UnmatchedColumns
from engine.data.preference import prepare_preference_data
from engine.data.sources import load_raw


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return DataConfig(source=str(path), max_seq_len=128)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="demo"))


def test_the_method_decides_how_an_ambiguous_file_reads(tmp_path):
    kto = _write(tmp_path / "kto.jsonl", [{"prompt": "7+5?", "completion": "12", "label": True}])
    assert preview.load_preview(kto).format.kind == "instruction"  # SFT reads instruction/output
    assert preview.load_preview(kto, "kto").format.kind == "labelled answers (KTO)"
    grpo = _write(tmp_path / "grpo.jsonl", [{"prompt": "7+5?", "answer": "12", "level": "easy"}])
    p = preview.load_preview(grpo, "grpo")
    assert p.format.kind == "prompts (GRPO)" and p.extra_columns == ["answer", "level"] and not p.error
    assert preview.load_preview(grpo).format.kind == "instruction" and preview.load_preview(grpo).extra_columns == []


def test_a_prompts_file_under_sft_says_why_and_sft_rows_under_dpo_say_what_dpo_reads(tmp_path):
    only = _write(tmp_path / "prompts.jsonl", [{"prompt": "7+5?", "target": "12"}])
    p = preview.load_preview(only)
    assert isinstance(p.error_detail, UnmatchedColumns) and p.error_detail.hint == preview.PROMPTS_ONLY
    assert "prompts without answers" in p.error and "pick GRPO" in p.error
    assert not preview.load_preview(only, "grpo").error
    # Unrelated columns get no prompts sentence.
    qa = _write(tmp_path / "qa.jsonl", [{"q": "7+5?", "a": "12"}])
    assert preview.load_preview(qa).error_detail.hint == ""
    sft = _write(tmp_path / "sft.jsonl", [{"instruction": "7+5?", "output": "12"}])
    assert preview.load_preview(sft).method_problem == ""
    problem = preview.load_preview(sft, "dpo").method_problem
    assert problem.startswith("DPO reads prompt / chosen / rejected pairs") and "chosen" in problem


def test_a_pairs_example_has_its_sides_as_training_packs_them(tmp_path, tok):
    cfg = _write(
        tmp_path / "pairs.jsonl",
        [{"prompt": "Name a colour.", "chosen": "Answer: red", "rejected": "Answer: a purple one"}],
    )
    ex = preview.render_example(tok, cfg, 0, "dpo")
    p, c, r = prepare_preference_data(cfg, tok, "paired", raw=load_raw(cfg)).examples[0]
    assert [len(ex.sides[k]) for k in ("prompt", "chosen", "rejected")] == [len(p), len(c), len(r)]
    assert not any(on for _, on in ex.sides["prompt"])
    assert all(on for _, on in ex.sides["chosen"] + ex.sides["rejected"])
    assert "purple" in "".join(t for t, _ in ex.sides["rejected"]) and ex.label is None
    kto = _write(tmp_path / "kto.jsonl", [{"prompt": "7+5?", "completion": "Answer: 75", "label": False}])
    ex = preview.render_example(tok, kto, 0, "kto")
    assert set(ex.sides) == {"prompt", "completion"} and ex.label is False
    grpo = _write(tmp_path / "grpo.jsonl", [{"prompt": "7+5?", "answer": "12"}])
    ex = preview.render_example(tok, grpo, 0, "grpo")
    assert ex.sides is None and ex.n_trained == 0 and ex.columns == {"answer": "12"}
