"""GRPO's sampler in a real session: a model the engine's decode loop refuses samples through
transformers' `generate`, and each step's fallbacks say so with the reason (`decode_loop: ...`),
although the counts made while generating are set aside; a model the loop takes counts nothing.
The refused model is the demo model with dynamic RoPE from 16 tokens on (rotary tables that
grow with the sequence past it), which the loop does not repeat."""

from __future__ import annotations

import json
import shutil

from engine.config import RewardConfig, RunConfig
from engine.events import Failed, StepMetrics
from engine.resources import DEMO_DATA_FILE, DEMO_MODEL_DIR, DEMO_PRESET
from engine.train.session import TrainingSession


def _prompts(path, n=12):
    with open(path, "w") as f:
        for line in DEMO_DATA_FILE.read_text().splitlines()[:n]:
            r = json.loads(line)
            f.write(json.dumps({"prompt": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")}) + "\n")
    return path


def _steps(tmp_path, model: str) -> list[StepMetrics]:
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.name_or_path = model
    cfg.training.method = "grpo"
    cfg.data.source = str(_prompts(tmp_path / "prompts.jsonl"))
    cfg.data.max_seq_len = 128
    cfg.training.max_steps = 2
    cfg.training.rows_per_micro_batch = 2
    cfg.training.grad_accum = 1
    cfg.training.save_every = 0
    cfg.training.device = "cpu"
    cfg.grpo.group_size = 2
    cfg.grpo.max_new_tokens = 6
    cfg.grpo.beta = 0.0
    cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"\d")]
    cfg.output.dir = str(tmp_path / "runs")
    events = []
    result = TrainingSession(cfg, events.append).run()
    if isinstance(result, Failed):
        raise AssertionError(result.message + "\n" + result.detail)
    return [e for e in events if isinstance(e, StepMetrics)]


def test_a_step_sampled_by_generate_counts_the_decode_loops_refusal(tmp_path):
    model = tmp_path / "dynamic-rope"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    # Dynamic RoPE from 16 tokens on: the prompts are longer, so the loop refuses it (inside, it repeats it).
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    config["rope_parameters"] = rope
    (model / "config.json").write_text(json.dumps(config))
    steps = _steps(tmp_path, str(model))
    assert len(steps) == 2
    want = "decode_loop: its rotary tables change with the sequence length (rope_type 'dynamic') past 16 tokens"
    for s in steps:
        assert s.fallbacks.get(want, 0) >= 1, s.fallbacks
        assert not any("KV cache" in k for k in s.fallbacks), s.fallbacks  # generate's own counts stay aside


def test_a_step_the_decode_loop_sampled_counts_no_fallback_for_it(tmp_path):
    steps = _steps(tmp_path, "demo")
    assert len(steps) == 2
    for s in steps:
        assert not any(k.startswith("decode_loop") for k in s.fallbacks), s.fallbacks
