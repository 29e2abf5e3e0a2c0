"""A user's run on model families beyond the demo, through `python -m engine train`.

A tiny random model folder of each family (transformers' own classes, saved with save_pretrained,
the demo's tokenizer and chat template beside it) trains a few steps from the command line on the
demo data: the run finishes, its loss falls, the log says which fast paths fell back and why, and
the adapter it saved loads into the stock model with PEFT and changes its logits. SmolLM3 takes the
fast paths (its NoPE layers), Cohere's logits are scaled, LFM2's convolutions run each document of
a packed row alone, GPT-2's LoRA goes on its Conv1D projections, and MPT, a family nobody here has
checked, passes the logits check and runs each document alone (engine.models.arch.packing). GPT-OSS
packs its rows: its attention sinks go through the packed attention, its experts through the grouping.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from engine.models.arch import TINY_BASE
from engine.resources import DEMO_MODEL_DIR

FAMILIES = {
    "smollm3": dict(no_rope_layers=[1, 0]),
    "cohere": dict(logit_scale=0.25),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "gpt2": {},
    "mpt": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
}
# What each family's log must say it fell back to (None: nothing expected).
FALLBACK = {
    "smollm3": None,
    "cohere": None,
    "lfm2": "each document runs alone",
    "gpt2": None,
    "mpt": "not a family the engine has checked keeps the documents of a packed row apart: each document runs alone",
    "gpt_oss": None,
}


def model_folder(model_type: str, extra: dict, path):
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = dict(vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the demo tokenizer's
    cfg = AutoConfig.for_model(model_type, **{**TINY_BASE, **ids, **extra})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO_MODEL_DIR / name, path)
    return path


@pytest.mark.slow  # one training child process per family
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_family_trains_from_the_command_line(model_type, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = model_folder(model_type, FAMILIES[model_type], tmp_path / model_type)
    config = {
        "model": {"name_or_path": str(folder)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"source": "demo", "train_on_responses_only": True, "max_seq_len": 256, "max_examples": 60},
        "training": {
            "max_steps": 10,
            "rows_per_micro_batch": 2,
            "lr": 0.005,
            "warmup_steps": 1,
            "scheduler": "constant",
            "seed": 1,
            "save_every": 100,
            "log_every": 1,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(path), "--output", str(run)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 10/10" in out.stdout and "finished" in out.stdout
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e.get("event") == "StepMetrics" and "loss" in e]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    said = out.stdout + out.stderr
    if FALLBACK[model_type] is None:
        assert "Fast path fallback" not in said
    else:
        assert FALLBACK[model_type] in said
    # The logits check runs for a family with no file of ours and not in the packing list only.
    assert ("a family tunesmith has not checked: its logits match" in said) == (model_type == "mpt")

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, run / "adapter")
        after = tuned(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-4
