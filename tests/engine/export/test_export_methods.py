"""Exports of runs trained by the methods beyond SFT (issue 30: "everything SFT has ... and the
exports"): the self-check scores held-out examples read as the run's method reads its data (a
pair's prompt with its chosen answer, a KTO row's completion, a GRPO prompt as text), so a DPO or
GRPO run's merged model is checked and written. It failed with 'the columns prompt, chosen,
rejected match no known shape' before, and nothing was written."""

from __future__ import annotations

import pytest

from engine.config import RewardConfig
from engine.export import export_and_check
from tests.engine.train.test_methods_session import config, run, write_pairs, write_prompts


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "grpo"])
def test_a_method_run_exports_merged_with_its_self_check(tmp_path, method):
    if method == "dpo":
        cfg = config(tmp_path, "dpo", write_pairs(tmp_path / "pairs.jsonl", n=16), steps=2)
    else:
        cfg = config(tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl", n=16), steps=2)
        cfg.grpo.group_size = 2
        cfg.grpo.max_new_tokens = 4
        cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"The .*")]
    cfg.output.run_name = method
    run(cfg)
    result = export_and_check(tmp_path / "runs" / method, {"merged": tmp_path / "merged"})
    (verdict,) = result.verdicts
    assert verdict.ok, verdict.summary
    assert (tmp_path / "merged" / "model.safetensors").is_file()
