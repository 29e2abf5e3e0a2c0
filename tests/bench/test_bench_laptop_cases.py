"""bench.laptop's case grammar: a cap, a model shape, QLoRA or not, and the case's own settings,
turned into the studio preset a user would run (a config the engine accepts)."""

from __future__ import annotations

import pytest

from bench.laptop import card_for, parse_case, run_config
from engine.config import RunConfig


def test_a_case_names_its_cap_card_model_and_overrides():
    assert parse_case("8:qwen3-4b-qlora") == (8, "qwen3-4b", True, {})
    assert parse_case("7.5:qwen3-8b-qlora+seq=8192+rows=1") == (7.5, "qwen3-8b", True, {"seq": 8192, "rows": 1})
    # A cap between two cards' sizes is the larger card with a desktop using the rest.
    assert card_for(7.5) == card_for(8) == "NVIDIA GeForce RTX 4060 Laptop GPU"
    for bad in ("8:qwen3-9b", "32:qwen3-4b", "8:qwen3-4b+depth=3", "x:qwen3-4b"):
        with pytest.raises(SystemExit):
            parse_case(bad)


def test_the_case_config_is_the_preset_with_the_case_settings(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    _, _, qlora, overrides = parse_case("16:qwen3-4b-qlora+seq=2048+rows=1+accum=8")
    cfg = RunConfig.load(run_config(tmp_path / "model", data, qlora, 20, tmp_path / "runs" / "a", overrides))
    assert cfg.model.load_in_4bit is True  # the laptop-qlora preset
    assert (cfg.data.max_seq_len, cfg.training.rows_per_micro_batch, cfg.training.grad_accum) == (2048, 1, 8)
    assert cfg.training.max_steps == 20 and cfg.training.save_every == 0

    plain = RunConfig.load(run_config(tmp_path / "model", data, False, 20, tmp_path / "runs" / "b", accum=1))
    assert plain.model.load_in_4bit == "auto"  # the quality preset: 4-bit only where 16-bit does not fit
    assert plain.training.rows_per_micro_batch == "auto" and plain.training.grad_accum == 1
