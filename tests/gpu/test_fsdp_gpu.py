"""FSDP2 on two GPUs (issue 18 item 2): a real-shape bf16 model sharded across 2 GPUs with the
fast paths on learns like the same run on one GPU, QLoRA under FSDP gives its one sentence, and
bench.fsdp runs a 70B-wide slice (2 layers of Llama-3.1-70B's widths) and learns.

Each run is `tunesmith train CONFIG [--gpus 2]` as a user starts it (torchrun, NCCL). The global
batch is the same (2 micro-batches of one 4096-token row a step: one per GPU), so the curves
match within bf16 noise: every step within 2%, the final loss within 1%, both falling by at
least 0.5 nats over 20 steps; the fused paths ran on every step with no fallback.

Run on a host with 2 GPUs:  python -m pytest -m gpu tests/gpu/test_fsdp_gpu.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from child_process import child_env
from learning_parity import random_model_folder

from engine.data.synthetic import write_text_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
SEQ = 4096
# A Llama-3-shaped slice: 4 layers at 8B widths, the demo tokenizer's vocabulary.
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=500_000.0,
    max_position_embeddings=131_072,
)
# The fast paths that must run on every step of both runs.
EXPECTED = ("lora_linears", "lora_mlp", "rmsnorm:triton", "rope:triton", "fused_ce:triton", "attention:varlen_triton")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def folder(root) -> Path:
    """Random bf16 weights of SHAPE and the demo tokenizer, as a local model folder."""
    return random_model_folder(root / "llama", "llama", **SHAPE)


@pytest.fixture(scope="module")
def data(root) -> Path:
    return write_text_jsonl(root / "data.jsonl", 1500, seed=0)


def _config(root: Path, name: str, folder: Path, data: Path, distributed: str, offload="off", **model) -> Path:
    cfg = {
        "model": {"name_or_path": str(folder), "dtype": "bfloat16", "load_in_4bit": False, **model},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"source": str(data), "format": "text", "max_seq_len": SEQ, "eval_fraction": 0.0},
        "training": {
            "max_steps": STEPS,
            "rows_per_micro_batch": 1,
            "grad_accum": 2,  # one micro-batch per GPU and step
            "lr": 1e-3,
            "warmup_steps": 2,
            "gradient_checkpointing": True,
            "offload": offload,
            "save_every": 10,
            "preflight": "off",
            "seed": 0,
            "distributed": distributed,
        },
        "fast_paths": {"kernels": True, "lora_autograd": True, "fused_ce": True, "packed_attention": True},
        "output": {"dir": str(root / "runs"), "run_name": name},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _train(*args) -> subprocess.CompletedProcess:
    env = child_env()
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )


def _steps(run: Path) -> list[dict]:
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in events if e["event"] == "StepMetrics"]


def _ran(steps: list[dict]) -> list[str]:
    problems = []
    for s in steps:
        calls = s["fast_path_calls"]
        missing = [k for k in EXPECTED if not calls.get(k)]
        if missing or s["fallbacks"]:
            problems.append(f"step {s['step']}: missing {missing}, fallbacks {s['fallbacks']}")
    return problems


@pytest.mark.parametrize("offload", ["off", "double"])
def test_fsdp_on_two_gpus_learns_like_one_gpu(root, folder, data, offload):
    if not (root / "runs" / "one" / "adapter").exists():  # the 1-GPU reference, shared by both cases
        one = _train(_config(root, "one", folder, data, "ddp"))
        assert one.returncode == 0, one.stderr[-3000:]
    name = f"two-{offload}"
    two = _train(_config(root, name, folder, data, "fsdp", offload=offload), "--gpus", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    s1, s2 = _steps(root / "runs" / "one"), _steps(root / "runs" / name)
    # The offloader ran on every step ("double", or "single (why)" when a buffer did not fit).
    assert all(bool(s["offload"]) == (offload != "off") for s in s2), [s["offload"] for s in s2]
    assert [s["step"] for s in s2] == list(range(1, STEPS + 1))
    log = (root / "runs" / name / "log.txt").read_text()
    assert "FSDP2: the base and the adapters are sharded across 2 processes" in log
    l1, l2 = [s["loss"] for s in s1], [s["loss"] for s in s2]
    table = "\n".join(f"{i + 1:3d} {a:.4f} {b:.4f} {b / a - 1:+.2%}" for i, (a, b) in enumerate(zip(l1, l2)))
    print(f"step  1-GPU  FSDP-2\n{table}")
    print("peak GiB: 1 GPU", s1[-1]["mem_peak"] / 2**30, "FSDP rank 0", s2[-1]["mem_peak"] / 2**30)
    assert l1[0] - l1[-1] >= 0.5, f"the 1-GPU curve did not fall:\n{table}"
    assert l2[0] - l2[-1] >= 0.5, f"the FSDP curve did not fall:\n{table}"
    assert all(abs(b / a - 1) <= 0.02 for a, b in zip(l1, l2)), table
    assert abs(l2[-1] / l1[-1] - 1) <= 0.01, table
    assert not _ran(s1) and not _ran(s2), (_ran(s1), _ran(s2))
    # The FSDP run's adapter is a normal PEFT adapter with full tensors.
    from safetensors.torch import load_file

    a1 = load_file(str(root / "runs" / "one" / "adapter" / "adapter_model.safetensors"))
    a2 = load_file(str(root / "runs" / name / "adapter" / "adapter_model.safetensors"))
    assert a1.keys() == a2.keys() and all(a1[k].shape == a2[k].shape for k in a1)


def test_qlora_under_fsdp_works_or_says_why(root, folder, data):
    """bitsandbytes' 4-bit weights are not sharded by FSDP2 here: one sentence, before any GPU work."""
    r = _train(_config(root, "q4", folder, data, "fsdp", load_in_4bit=True), "--gpus", 2)
    if r.returncode == 0:  # should FSDP ever take a 4-bit base, it must learn
        steps = _steps(root / "runs" / "q4")
        assert steps[0]["loss"] - steps[-1]["loss"] >= 0.5
    else:
        assert "a 4-bit base is not sharded across GPUs here: use DDP" in r.stderr, r.stderr[-2000:]


def test_bench_fsdp_70b_wide_slice(root):
    """Two decoder layers at Llama-3.1-70B's widths (8192 hidden, 28672 MLP, 128256 vocab)."""
    out = root / "fsdp.jsonl"
    env = child_env()
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bench.fsdp"]
        + ["--layers", "2", "--steps", "8", "--seq-len", "4096", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    print(json.dumps(rec, indent=1))
    assert rec["world_size"] == 2 and rec["steps_done"] == 8 and rec["learned"], rec["losses"]
    assert all(v == "on" for k, v in rec["fast_paths"].items() if k in ("lora_qkv", "lora_mlp", "rmsnorm", "fused_ce"))
