"""The laptop bench's DPO case (issue 30, docs/GPU.md W8): "+method=dpo" in a case's grammar, the
pairs file it trains on (learnable like the SFT data, ~1,024 tokens a side), and the case's config
run by `python -m engine train` as a user runs it, here on the demo model on a CPU for two steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.laptop import DEMO_MODEL, ROOT, case_data, parse_case, run_config, summarize_run
from engine.config import RunConfig

CASE = "7.5:qwen3-8b-qlora+method=dpo+seq=2048"


def test_a_case_names_its_method():
    assert parse_case(CASE) == (7.5, "qwen3-8b", True, {"method": "dpo", "seq": 2048})
    assert parse_case("8:qwen3-4b+method=sft")[3] == {"method": "sft"}
    for bad in ("8:qwen3-4b+method=grpo", "8:qwen3-4b+method=", "8:qwen3-4b+seq=long"):
        with pytest.raises(SystemExit):
            parse_case(bad)


def test_the_dpo_case_reads_learnable_pairs_of_about_1024_tokens(tmp_path):
    from transformers import AutoTokenizer

    from engine.data.preference import prepare_preference_data

    _, _, qlora, overrides = parse_case(CASE)
    data = case_data(tmp_path, overrides)
    assert data.name == "pairs.jsonl" and case_data(tmp_path, {}).name == "data.jsonl"
    cfg = RunConfig.load(run_config(tmp_path / "model", data, qlora, 8, tmp_path / "runs" / "a", overrides))
    assert cfg.training.method == "dpo" and cfg.data.max_seq_len == 2048 and cfg.model.load_in_4bit is True

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(rows) == 1500
    for r in rows[:50]:
        chosen, rejected = r["chosen"].split(), r["rejected"].split()
        assert sorted(chosen) == sorted(rejected) and chosen != rejected  # same words, the order broken

    cfg.data.source = str(tmp_path / "head.jsonl")
    (tmp_path / "head.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    prepared = prepare_preference_data(cfg.data, tok, "paired")
    assert len(prepared.examples) == 40  # none dropped
    sides = [len(p) + len(c) for p, c, _ in prepared.examples]
    rows_tokens = [2 * len(p) + len(c) + len(r) for p, c, r in prepared.examples]
    assert 700 < sum(sides) / len(sides) < 1400, sum(sides) / len(sides)
    assert max(rows_tokens) <= 2048


def test_the_dpo_case_trains_through_engine_train(tmp_path):
    """The case's config with the demo model in place of the random 8B (no 4-bit on a CPU):
    `python -m engine train` trains DPO on the pairs; the laptop record reads its steps."""
    _, _, _, overrides = parse_case("8:qwen3-8b+method=dpo+seq=2048+rows=1+accum=1")
    data = case_data(tmp_path, overrides)
    run = tmp_path / "runs" / "dpo"
    cfg_path = run_config(DEMO_MODEL, data, False, 2, run, overrides)
    cfg = RunConfig.load(cfg_path)
    cfg.model.load_in_4bit = False
    cfg.training.warmup_steps = 0
    cfg.data.eval_fraction = 0.0
    cfg.save(cfg_path)
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(cfg_path), "--output", str(run), "--events-json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = summarize_run(run, 8)
    assert rec["steps"] == 2 and rec["outcome"] == "Finished", rec
    # The adapter starts at zero: policy and reference agree, DPO's loss is log 2.
    assert rec["loss_first"] == pytest.approx(math.log(2), abs=1e-3)
    last = rec["method_metrics"]["last"]
    assert "rewards/margins" in last and "rewards/accuracies" in last
