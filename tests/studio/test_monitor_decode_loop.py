"""The Monitor names GRPO's decode-loop fallback: a run whose model the engine's decode loop refuses
samples through transformers' `generate` (slower), each step counts `decode_loop: <why>`, and the
banner says so with the reason. The events are a real GRPO session's on the CPU (the demo model
with dynamic RoPE from 16 tokens on, which the loop refuses), so the run's fast-path report key and the counted
fallback key are the engine's own, not written here."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.config import RewardConfig, RunConfig
from engine.events import Failed, RunStarted, StepMetrics
from engine.resources import DEMO_DATA_FILE, DEMO_MODEL_DIR, DEMO_PRESET
from engine.train.session import TrainingSession

REASON = "its rotary tables change with the sequence length (rope_type 'dynamic') past 16 tokens"


def _prompts(path, n=8):
    with open(path, "w") as f:
        for line in DEMO_DATA_FILE.read_text().splitlines()[:n]:
            r = json.loads(line)
            f.write(json.dumps({"prompt": r["instruction"]}) + "\n")
    return path


@pytest.fixture(scope="module")
def grpo_events(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    model = tmp / "dynamic-rope"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    # Dynamic RoPE from 16 tokens on: the prompts are longer, so the loop refuses it (inside, it repeats it).
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    config["rope_parameters"] = rope
    (model / "config.json").write_text(json.dumps(config))
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.name_or_path = str(model)
    cfg.training.method = "grpo"
    cfg.data.source = str(_prompts(tmp / "prompts.jsonl"))
    cfg.data.max_seq_len = 128
    cfg.training.max_steps = 2
    cfg.training.rows_per_micro_batch = 2
    cfg.training.grad_accum = 1
    cfg.training.save_every = 0
    cfg.training.device = "cpu"
    cfg.grpo.group_size = 2
    cfg.grpo.max_new_tokens = 4
    cfg.grpo.beta = 0.0
    cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"\d")]
    cfg.output.dir = str(tmp / "runs")
    events = []
    result = TrainingSession(cfg, events.append).run()
    if isinstance(result, Failed):
        raise AssertionError(result.message + "\n" + result.detail)
    return events


@pytest.fixture
def monitor(qtbot):
    from studio.panels.monitor import MonitorPanel

    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.begin()
    yield panel
    panel.close()


def test_the_run_asks_for_the_decode_loop_under_the_key_its_fallback_counts(grpo_events):
    started = next(e for e in grpo_events if isinstance(e, RunStarted))
    assert started.fast_paths["decode_loop"].startswith("on")
    steps = [e for e in grpo_events if isinstance(e, StepMetrics)]
    assert steps and all(s.fallbacks.get(f"decode_loop: {REASON}", 0) >= 1 for s in steps)


def test_the_banner_names_the_decode_loop_fallback_and_why(monitor, grpo_events):
    for event in grpo_events:
        if isinstance(event, RunStarted):
            monitor.run_started(event)
        elif isinstance(event, StepMetrics):
            monitor.step(event)
    text = monitor.banner.text()
    assert monitor.banner.level == "warning"
    assert f"decode_loop fell back: {REASON}" in text
    assert "sampled its completions through transformers' generate" in text
    assert "Those layers ran the slower stock path" not in text  # no layer fell back in this run
    assert monitor.log.toPlainText().count("fast path decode_loop was requested") == 1  # once, not per step


def test_a_step_the_decode_loop_sampled_shows_nothing_about_it(monitor, grpo_events):
    started = next(e for e in grpo_events if isinstance(e, RunStarted))
    step = next(e for e in grpo_events if isinstance(e, StepMetrics))
    monitor.run_started(started)
    fallbacks = {k: v for k, v in step.fallbacks.items() if not k.startswith("decode_loop")}
    calls = dict(step.fast_path_calls) or {"lora_linears": 1}
    monitor.step(StepMetrics(**{**step.__dict__, "fallbacks": fallbacks, "fast_path_calls": calls}))
    assert "decode_loop" not in monitor.banner.text()
