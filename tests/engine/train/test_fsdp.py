"""FSDP2 (issue 18 item 2) on the CPU with gloo: `training.distributed: fsdp` under
`tunesmith train --gpus 2` shards the base and the adapters (fully_shard per decoder layer and
the root, DeviceMesh "cpu") and learns what one process learns at the same global batch; its
adapter is a normal PEFT adapter; its checkpoints hold full tensors, so a 2-process FSDP
checkpoint resumes exactly on one process and a 1-process checkpoint under FSDP; a 4-bit base is
refused with one sentence; bench.fsdp runs at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from child_process import child_env
from safetensors.torch import load_file

from engine.config import FSDP_4BIT_REFUSAL, ConfigError, RunConfig
from engine.resources import DEMO_PRESET

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, name: str, distributed: str, fast: bool = False, accum: int = 2) -> Path:
    cfg = yaml.safe_load(Path(DEMO_PRESET).read_text())
    cfg["model"]["dtype"] = "float32"
    cfg["training"].update(
        max_steps=4,
        rows_per_micro_batch=2,
        grad_accum=accum,  # 2: one micro-batch per process and step
        save_every=2,
        optimizer="adamw",
        device="cpu",
        preflight="off",
        distributed=distributed,
    )
    if fast:
        # The patched forwards and fused LoRA Functions (their torch references on a CPU) read
        # the layer weights: under FSDP they must see the gathered, plain tensors.
        cfg["fast_paths"] = {"kernels": True, "lora_autograd": True, "fused_ce": True}
        cfg["training"]["gradient_checkpointing"] = True
        cfg["training"]["offload"] = "single"  # the layer call, FSDP's hooks included, in its Function
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(*args) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )


def _steps(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "StepMetrics":
            out[e["step"]] = e
    return out


def _gallery(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "gallery.jsonl").read_text().splitlines()]


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: a tolerance that holds whatever order a CPU's kernels sum in."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _same_adapters(got: Path, want: Path, rel: float = 1e-4) -> None:
    a, b = load_file(str(got / "adapter_model.safetensors")), load_file(str(want / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].shape == b[k].shape, k
        assert _rel_err(a[k], b[k]) < rel, (k, _rel_err(a[k], b[k]))


# The stock case deals 2 micro-batches to each process per step: the first accumulates without a
# reduce-scatter (set_requires_gradient_sync(False)), the second reduces the sum.
@pytest.mark.parametrize("fast,accum", [(False, 4), (True, 2)], ids=["stock-accum4", "fast-paths"])
def test_fsdp_two_processes_learn_what_one_learns(tmp_path, fast, accum):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _train(_config(tmp_path, "one", "ddp", fast, accum), "--output", one)  # one process ignores the switch
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _train(_config(tmp_path, "two", "fsdp", fast, accum), "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    log = (two / "log.txt").read_text()
    assert "FSDP2: the base and the adapters are sharded across 2 processes" in log
    s1, s2 = _steps(one), _steps(two)
    assert sorted(s2) == [1, 2, 3, 4]
    for step in s1:
        assert _close(s2[step]["loss"], s1[step]["loss"]), (step, s1[step]["loss"], s2[step]["loss"])
        assert _close(s2[step]["grad_norm"], s1[step]["grad_norm"], 1e-4)
    if fast:  # the fused paths and the offloader ran on rank 0's share, with no fallback
        assert all(s["offload"] == "single" for s in s2.values())
        calls = s2[1]["fast_path_calls"]
        assert calls.get("lora_linears") and calls.get("lora_mlp") and calls.get("rmsnorm:torch"), calls
        assert not any(s["fallbacks"] for s in s2.values())
    _same_adapters(two / "adapter", one / "adapter")
    _same_adapters(two / "checkpoints" / "step-2" / "adapter", one / "checkpoints" / "step-2" / "adapter")
    # The gallery: every rank runs its forwards (each gathers its layers from all), rank 0
    # records, and the sharded model answers what the whole one does (greedy, fp32 weights equal
    # to 1e-4 and far apart top logits).
    g1, g2 = _gallery(one), _gallery(two)
    assert [(g["step"], g["prompt"]) for g in g2] == [(g["step"], g["prompt"]) for g in g1]
    assert sorted({g["step"] for g in g2}) == [2, 4] and len(g2) == 6, g2
    assert [g["answer"] for g in g2] == [g["answer"] for g in g1] and all(g["answer"] for g in g2)


def test_fsdp_checkpoint_is_full_loads_in_peft_and_resumes_on_one_process(tmp_path):
    cfg1, cfg2 = _config(tmp_path, "one", "ddp"), _config(tmp_path, "two", "fsdp")
    one, two = tmp_path / "one", tmp_path / "two"
    assert _train(cfg1, "--output", one).returncode == 0
    r2 = _train(cfg2, "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    l1 = {k: v["loss"] for k, v in _steps(one).items()}

    # The optimizer state is whole (AdamW's moments shaped like the full adapters).
    opt1 = torch.load(one / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    opt2 = torch.load(two / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    assert opt1["state"].keys() == opt2["state"].keys()
    for idx, s in opt1["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt2["state"][idx][key].shape == s[key].shape
            assert _rel_err(opt2["state"][idx][key], s[key]) < 1e-3, (idx, key)

    # A normal PEFT adapter: PEFT loads it onto the base and it holds the trained weights.
    from peft import PeftModel

    from engine.config import ModelConfig
    from engine.models.loading import load_model

    base = load_model(ModelConfig(name_or_path="demo"), "cpu", "float32")
    peft_model = PeftModel.from_pretrained(base, str(two / "adapter"))
    saved = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    params = dict(peft_model.named_parameters())
    for k, v in saved.items():
        name = k.replace(".weight", ".default.weight")
        assert torch.equal(params[name].detach(), v), k

    # The 2-process FSDP checkpoint of step 2, resumed by one process: steps 3-4 as uninterrupted.
    resumed = _train(cfg2, "--resume", two / "checkpoints" / "step-2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = {k: v["loss"] for k, v in _steps(two).items()}
    for step in (3, 4):
        assert _close(after[step], l1[step]), (step, after[step], l1[step])

    # And the 1-process checkpoint resumed under FSDP on 2 processes.
    back = _train(cfg2, "--resume", one / "checkpoints" / "step-2", "--gpus", 2)
    assert back.returncode == 0, back.stderr[-3000:]
    again = {k: v["loss"] for k, v in _steps(one).items()}
    for step in (3, 4):
        assert _close(again[step], l1[step]), (step, again[step], l1[step])


def test_a_4bit_base_under_fsdp_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"model": {"load_in_4bit": True}, "training": {"distributed": "fsdp"}})
    assert err.value.path == "training.distributed"
    assert "a 4-bit base is not sharded across GPUs here: use DDP" in str(err.value)
    assert FSDP_4BIT_REFUSAL in str(err.value)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"distributed": "zero3"}})
    assert err.value.path == "training.distributed" and "'fsdp'" in str(err.value)  # the field, and the choices
    # The command line says it before anything starts (the window gets it as a Failed/validation error).
    cfg = yaml.safe_load(_config(tmp_path, "q", "fsdp").read_text())
    cfg["model"]["load_in_4bit"] = True
    path = tmp_path / "q4.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _train(path, "--output", tmp_path / "q4", "--gpus", 2)
    assert r.returncode != 0 and "a 4-bit base is not sharded across GPUs here" in r.stderr


def test_distributed_default_shards_only_a_base_over_one_device():
    from types import SimpleNamespace

    from engine.hardware import policy

    budget = policy.Budget(True, 80 * 2**30, 96 * 2**30, 90 * 2**30, "VRAM", "datacenter")
    # The decision reads the parameter count only.
    big, small = SimpleNamespace(num_params=70_000_000_000), SimpleNamespace(num_params=8_000_000_000)
    assert policy.distributed_default(budget, big, False)[0] == "fsdp"
    assert policy.distributed_default(budget, small, False)[0] == "ddp"
    assert policy.distributed_default(budget, big, True)[0] == "ddp"
    assert policy.distributed_default(budget, None, False)[0] == "ddp"


def _bench(out: Path, *extra: str) -> dict:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    args = "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --vocab 512 --seq-len 128"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "bench.fsdp"]
        + args.split()
        + [*extra, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text().splitlines()[-1])


def test_bench_fsdp_runs_tiny(tmp_path):
    out = tmp_path / "fsdp.jsonl"
    rec = _bench(out, "--steps", "6", "--lr", "3e-3")
    assert rec["world_size"] == 2 and rec["steps_done"] == 6 and len(rec["losses"]) == 6
    assert rec["learned"], rec["losses"]
    assert rec["tokens_per_s_median"] > 0 and rec["shape"]["layers"] == 2
    assert rec["fast_paths"]["lora_mlp"] == "on" and not rec["stopped_early"]
    # A time limit: it stops between steps and still appends what it measured.
    rec = _bench(out, "--steps", "100000", "--max-seconds", "15")
    assert rec["stopped_early"] and 1 <= rec["steps_done"] < 100000 == rec["steps"]
    assert len(out.read_text().splitlines()) == 2


_ROLLBACK_WORKER = """
import sys
from engine.config import RunConfig
from engine.train.session import Faults, TrainingSession
TrainingSession(RunConfig.load(sys.argv[1]), run_dir=sys.argv[2], faults=Faults(spike_at_steps=[13])).run()
"""


def test_fsdp_rollback_restores_each_ranks_shards(tmp_path):
    """A loss spike at step 13 rolls back to the snapshot of step 10 (adapters and AdamW moments
    as each rank's shards in host memory): the run goes on exactly as one process does."""
    worker = tmp_path / "worker.py"
    worker.write_text(_ROLLBACK_WORKER)
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    runs = {}
    for name, distributed, launch in (
        ("one", "ddp", [sys.executable]),
        ("two", "fsdp", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]),
    ):
        cfg = yaml.safe_load(_config(tmp_path, name, distributed).read_text())
        cfg["training"].update(max_steps=15, rows_per_micro_batch=1, warmup_steps=2, save_every=0, eval_every=0)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        r = subprocess.run(
            launch + [str(worker), str(path), str(tmp_path / name)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        events = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = events
    for events in runs.values():
        (back,) = [e for e in events if e["event"] == "RolledBack"]
        assert (back["step"], back["to_step"], back["reason"]) == (13, 10, "spike")
        assert events[-1]["event"] == "Finished"
    l1 = [e["loss"] for e in runs["one"] if e["event"] == "StepMetrics"]
    l2 = [e["loss"] for e in runs["two"] if e["event"] == "StepMetrics"]
    assert len(l1) == len(l2) == 12 + 5  # steps 1-12, then 11-15 again after the rollback
    for a, b in zip(l1, l2):
        assert _close(a, b, 1e-4), (l1, l2)
    _same_adapters(tmp_path / "two" / "adapter", tmp_path / "one" / "adapter")


def test_fsdp_stop_from_the_control_file_saves_and_ends_every_rank(tmp_path):
    """The window's stop reaches rank 0 through the run's control file; every rank agrees, takes
    part in gathering the checkpoint, and the run ends stopped (no rank left in a collective)."""
    import time

    cfg = yaml.safe_load(_config(tmp_path, "stop", "fsdp").read_text())
    cfg["training"]["max_steps"] = 400
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", str(path), "--output", str(run), "--gpus", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (run / "checkpoints" / "step-2").exists() and proc.poll() is None:
            time.sleep(0.5)
        assert (run / "checkpoints" / "step-2").exists(), proc.communicate()[1][-2000:]
        (run / "control").write_text("stop")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped: steps=" in out + err
    last = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert 2 <= last < 400
    assert (run / "checkpoints" / f"step-{last}" / "adapter" / "adapter_model.safetensors").exists()
