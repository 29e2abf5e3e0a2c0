"""GRPO under FSDP2 on two GPUs (issue 30): the CPU test (tests/engine/train/test_grpo_fsdp.py,
gloo) on NCCL. The groups are sampled and the held-out prompts answered greedily on the sharded
model (the root's weights gathered, each decoder layer gathering itself, generate with
synced_gpus), with the CUDA streams FSDP2 sets up at its root's lazy init, which here happens
before any training forward. The run must finish with every step scored and both evals over all
6 held-out prompts, and its first eval (after one step, fp32) must answer as one GPU does.

Run on a host with 2 GPUs:  python -m pytest -m gpu tests/gpu/test_grpo_fsdp_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.engine.train.test_grpo_fsdp import _config, _events, _train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _on_cuda(path):
    cfg = yaml.safe_load(path.read_text())
    cfg["training"]["device"] = "cuda"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_grpo_samples_and_evaluates_under_fsdp_on_two_gpus(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _train(_on_cuda(_config(tmp_path, "one", "ddp")), "--output", one)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _train(_on_cuda(_config(tmp_path, "two", "fsdp")), "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "FSDP2: the base and the adapters are sharded across 2 processes" in (two / "log.txt").read_text()
    steps = _events(two, "StepMetrics")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(0 < s["metrics"]["completion_length"] <= 6 for s in steps)
    e1, e2 = _events(one, "EvalMetrics"), _events(two, "EvalMetrics")
    assert [e["step"] for e in e2] == [1, 2] and all(e["examples"] == 6 and e["tokens"] == 6 for e in e2)
    for key, value in e1[0]["metrics"].items():
        assert e2[0]["metrics"][key] == pytest.approx(value, abs=1e-6), key
