"""GRPO learns on the bundled demo model, through the real TrainingSession: a regular-expression
format reward rises from its start to at least 0.8.

The demo model was pretrained on plain sentences ("7 plus 5 makes 12.", "The capital of Peru is
Lima."); asked a question it answers with one of them. The reward asks for the second form, a
sentence that starts with "The": the base model samples it about a quarter of the time, so the
groups have spread and GRPO has a signal. (The demo's `Answer: <value>` format is out of reach
from the base model: it gives "Answer" a probability of about 2e-6 after the prompt, so every
group scores 0, every advantage is 0 and nothing is learned; that check needs an SFT cold start
first.) The test fails if the reward does not rise: the first steps' mean must be below 0.5."""

from __future__ import annotations

import pytest

from engine.config import RewardConfig
from tests.engine.test_methods_session import config, run, write_prompts


@pytest.mark.slow
def test_grpo_raises_a_format_reward_on_the_demo_model(tmp_path):
    cfg = config(tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl", n=64), steps=40)
    cfg.training.rows_per_micro_batch = 4  # four prompts a step
    cfg.training.lr = 1e-3
    cfg.training.scheduler = "constant"
    cfg.training.warmup_steps = 0
    cfg.training.seed = 0
    cfg.grpo.group_size = 8
    cfg.grpo.max_new_tokens = 8
    cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"The .*")]
    _, steps = run(cfg)
    rewards = [s.metrics["rewards/format/mean"] for s in steps]
    start = sum(rewards[:3]) / 3
    end = sum(rewards[-5:]) / 5
    assert start < 0.5, rewards
    assert end >= 0.8, rewards
    assert all(s.metrics["reward"] == pytest.approx(s.metrics["rewards/format/mean"]) for s in steps)
