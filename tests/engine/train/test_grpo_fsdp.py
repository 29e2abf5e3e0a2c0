"""GRPO under FSDP2 (issue 30) on the CPU with gloo: `tunesmith train --gpus 2` with
`training.distributed: fsdp` samples its groups and answers its held-out prompts greedily from
the sharded model (the root's weights gathered around each generation, every rank stepping
until all have ended: StepContext.gathered / synced), and its eval says what one process says.

Before, the first generation failed with "aten.embedding.default got mixed torch.Tensor and
DTensor" (generate calls the PEFT model directly, whose embeddings were still a shard).

The rewards make the comparison one that can fail: a user reward that is a fingerprint of each
completion's text (equal means only when the answers are equal) beside the demo's format.

The reference passes of DPO and KTO (adapters off, and KTO's policy KL pass) call the model
directly too and failed the same way: they run with the root gathered now, and learn what one
process learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from child_process import child_env

from engine.resources import DEMO_DATA_FILE, DEMO_PRESET
from tests.engine.train.test_methods_session import write_pairs, write_unpaired

pytestmark = pytest.mark.slow

FINGERPRINT = '''
def reward(prompt, completion, **row):
    """A number that changes with every character of the completion and its place."""
    return sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 997 / 997
'''


def _prompts(path: Path, lines: list[str]) -> Path:
    with open(path, "w") as f:
        for r in map(json.loads, lines):
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            f.write(json.dumps({"prompt": prompt, "answer": r["output"].removeprefix("Answer: ")}) + "\n")
    return path


def _config(tmp_path: Path, name: str, distributed: str) -> Path:
    rows = DEMO_DATA_FILE.read_text().splitlines()
    (tmp_path / "fingerprint.py").write_text(FINGERPRINT)
    cfg = yaml.safe_load(Path(DEMO_PRESET).read_text())
    cfg["model"]["dtype"] = "float32"
    cfg["data"].update(
        source=str(_prompts(tmp_path / "prompts.jsonl", rows[:24])),
        eval_source=str(_prompts(tmp_path / "held.jsonl", rows[40:46])),  # 6 prompts: 3 batches of 2
        max_seq_len=128,
    )
    cfg["training"].update(
        method="grpo",
        max_steps=2,
        rows_per_micro_batch=2,
        grad_accum=2,  # one micro-batch per process and step
        save_every=0,
        eval_every=1,
        gallery_size=0,
        optimizer="adamw",
        device="cpu",
        preflight="off",
        distributed=distributed,
    )
    cfg["grpo"] = {
        "group_size": 2,
        "max_new_tokens": 6,
        "beta": 0.04,  # the reference pass (adapters off) runs on the sharded model too
        "rewards": [
            {"kind": "regex", "pattern": r"Answer: .+"},
            {"kind": "python", "file": str(tmp_path / "fingerprint.py")},
        ],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(*args) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_grpo_samples_and_evaluates_greedily_under_fsdp_as_one_process_does(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _train(_config(tmp_path, "one", "ddp"), "--output", one)  # one process ignores the switch
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _train(_config(tmp_path, "two", "fsdp"), "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "FSDP2: the base and the adapters are sharded across 2 processes" in (two / "log.txt").read_text()

    # Training: both steps sampled their groups on the sharded model and were scored.
    steps = _events(two, "StepMetrics")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert {"reward", "rewards/format/mean", "rewards/fingerprint/mean", "kl"} <= s["metrics"].keys()
        assert 0 < s["metrics"]["completion_length"] <= 6

    # The eval after each step: all 6 held-out prompts answered, and the same answers as one
    # process gives (the fingerprint's mean and spread, the lengths, the loss).
    e1, e2 = _events(one, "EvalMetrics"), _events(two, "EvalMetrics")
    assert [e["step"] for e in e2] == [e["step"] for e in e1] == [1, 2]
    for a, b in zip(e1, e2):
        assert b["examples"] == 6 and b["tokens"] == 6  # one greedy answer per prompt
        assert b["metrics"]["completion_length"] > 0
        assert b["metrics"]["rewards/fingerprint/std"] > 0  # the answers differ from each other
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-6)
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, abs=1e-6), (b["step"], key)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_the_reference_passes_of_dpo_and_kto_run_under_fsdp_as_on_one_process(tmp_path, method):
    write = write_pairs if method == "dpo" else write_unpaired
    paths = []
    for name, distributed in (("one", "ddp"), ("two", "fsdp")):
        cfg = yaml.safe_load(Path(DEMO_PRESET).read_text())
        cfg["model"]["dtype"] = "float32"
        cfg["data"].update(
            source=str(write(tmp_path / f"{method}.jsonl", n=16)),
            eval_source=str(write(tmp_path / f"{method}-held.jsonl", n=4)),
            max_seq_len=128,
        )
        cfg["training"].update(
            method=method,
            max_steps=2,
            rows_per_micro_batch=2,
            grad_accum=2,
            save_every=0,
            eval_every=2,
            gallery_size=0,
            optimizer="adamw",
            device="cpu",
            preflight="off",
            distributed=distributed,
        )
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _train(paths[0], "--output", one)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _train(paths[1], "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    s1, s2 = _events(one, "StepMetrics"), _events(two, "StepMetrics")
    assert [s["step"] for s in s2] == [1, 2]
    for a, b in zip(s1, s2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (b["step"], a["loss"], b["loss"])
        assert b["metrics"]["kl" if method == "kto" else "rewards/margins"] == pytest.approx(
            a["metrics"]["kl" if method == "kto" else "rewards/margins"], rel=1e-4, abs=1e-6
        )
    e1, e2 = _events(one, "EvalMetrics"), _events(two, "EvalMetrics")
    assert len(e2) == len(e1) == 1
    assert e2[0]["eval_loss"] == pytest.approx(e1[0]["eval_loss"], rel=1e-5)
