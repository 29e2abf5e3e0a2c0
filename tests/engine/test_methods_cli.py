"""`tunesmith train` runs the preference and GRPO methods from a YAML config, in a subprocess:
DPO on pairs, GRPO with a built-in format reward and the user's own reward file. A reward file
that fails names itself and the row, and the run ends with that message (not a traceback)."""

from __future__ import annotations

import re

import pytest
import yaml

from engine.resources import DEMO_PRESET
from tests.engine.test_cli import cli
from tests.engine.train.test_methods_session import write_pairs, write_prompts


def _config(tmp_path, method, source, **grpo):
    cfg = yaml.safe_load(DEMO_PRESET.read_text())
    cfg["data"].update(source=str(source), max_seq_len=128)
    cfg["training"].update(method=method, max_steps=2, rows_per_micro_batch=2)
    if grpo:
        cfg["grpo"] = grpo
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow  # trains in a child process
def test_dpo_from_the_command_line(tmp_path):
    path = _config(tmp_path, "dpo", write_pairs(tmp_path / "pairs.jsonl"))
    out = cli("train", str(path), "--output", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 2/2" in out.stdout and "finished" in out.stdout
    # Each step line shows what tells a DPO run's progress beside its loss.
    assert re.search(r"step 2/2 .* margin -?[0-9.e-]+  acc [0-9.]+", out.stdout), out.stdout
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow  # trains in a child process, generating completions
def test_grpo_with_a_user_reward_file_from_the_command_line(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return float(row['answer'] in completion)\n")
    rewards = [{"kind": "regex", "pattern": r"Answer: [^\n]+"}, {"kind": "python", "file": str(reward)}]
    path = _config(
        tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl"), group_size=2, max_new_tokens=6, rewards=rewards
    )
    out = cli("train", str(path), "--output", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finished" in out.stdout
    assert re.search(r"step 1/\d+ .* reward [0-9.e-]+ ± [0-9.e-]+ .* len [0-9.]+", out.stdout), out.stdout

    reward.write_text("def reward(prompt, completion, **row):\n    return row['no_such_column']\n")
    out = cli("train", str(path), "--output", str(tmp_path / "run2"))
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert "reward 'my_reward' failed on row" in said and "KeyError" in said and "Traceback" not in said
