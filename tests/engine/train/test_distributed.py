"""Several processes (issue 18), on the CPU with gloo: `tunesmith train --gpus 2` learns exactly
what one process learns at the same global batch, a checkpoint of a 2-process run resumes on one,
and a rank that dies ends the run with a message and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from child_process import child_env
from safetensors.torch import load_file

from engine.resources import DEMO_PRESET

pytestmark = pytest.mark.slow  # each test starts torchrun and two or more training processes
ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, steps: int = 6, save_every: int = 3) -> Path:
    cfg = yaml.safe_load(Path(DEMO_PRESET).read_text())
    cfg["model"]["dtype"] = "float32"
    cfg["training"].update(
        max_steps=steps,
        rows_per_micro_batch=2,
        grad_accum=2,  # two micro-batches a step: one per process
        save_every=save_every,
        optimizer="adamw",
        device="cpu",
        preflight="off",
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(*args, **popen) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "engine", "train", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        **popen,
    )


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "StepMetrics":
            out[e["step"]] = e["loss"]
    return out


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def test_two_processes_learn_what_one_learns_and_resume_on_one(tmp_path):
    cfg = _config(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = _train(cfg, "--output", one)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = _train(cfg, "--output", two, "--gpus", 2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "2 CPU processes (gloo)" in r2.stderr
    l1, l2 = _losses(one), _losses(two)
    assert sorted(l2) == list(range(1, 7))  # rank 0 alone reports, once per step
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5), (step, l1, l2)
    a1, a2 = _adapter(one / "adapter"), _adapter(two / "adapter")
    assert a1.keys() == a2.keys()
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-4, atol=1e-6)
    assert not list(two.glob("*.tmp")) and not list((two / "checkpoints").glob("*.tmp"))

    # The 2-process checkpoint of step 3, resumed by one process: steps 4-6 as uninterrupted.
    resumed = _train(cfg, "--resume", two / "checkpoints" / "step-3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = _losses(two)  # the resumed steps were appended to the same run
    for step in (4, 5, 6):
        assert after[step] == pytest.approx(l1[step], rel=1e-5)


def test_grad_accum_must_be_shared_out(tmp_path):
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    cfg["training"]["grad_accum"] = 3
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _train(path, "--output", tmp_path / "odd", "--gpus", 2)
    assert r.returncode == 2 and "training.grad_accum (3) must be a multiple of the number of processes (2)" in r.stderr


def _rank_pids(parent: int) -> dict[int, int]:
    """{rank: pid} of the training processes under `parent` (from their environment). A rank's own children
    inherit its RANK (Python 3.14's multiprocessing starts a resource tracker in each rank): the rank is the
    process whose parent has no RANK."""
    ranked = {}  # pid: (rank, parent pid)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        vars_ = dict(v.split(b"=", 1) for v in env if b"=" in v)
        if vars_.get(b"TUNESMITH_TEST_RUN") == str(parent).encode() and b"RANK" in vars_:
            if ") Z " not in stat:
                ranked[int(proc.name)] = (int(vars_[b"RANK"]), int(stat.rsplit(")", 1)[1].split()[1]))
    return {rank: pid for pid, (rank, ppid) in ranked.items() if ppid not in ranked}


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_rank_that_dies_ends_the_run_cleanly(tmp_path):
    cfg = _config(tmp_path, steps=400, save_every=2)
    run = tmp_path / "dies"
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", str(cfg), "--output", str(run), "--gpus", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env, TUNESMITH_TEST_RUN=str(os.getpid())),
        start_new_session=True,
    )
    try:
        # The marker is this test process's pid, so concurrent tests never see each other's ranks.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (run / "checkpoints" / "step-2").exists():
            time.sleep(0.5)
        assert (run / "checkpoints" / "step-2").exists(), proc.stderr.read()[-2000:] if proc.poll() else "no checkpoint"
        ranks = _rank_pids(os.getpid())
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    assert "a training process ended with status" in err and "--resume" in err
    # The launcher has returned; its ranks may still be in the kernel's exit path: wait for them to go
    # (the deadline only stops a hang; a rank left behind fails it).
    deadline = time.monotonic() + 60
    while _rank_pids(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rank_pids(os.getpid()) == {}, "a training process was left behind"
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if p.is_dir())
    assert steps and not list((run / "checkpoints").glob("*.tmp"))
    # The last checkpoint is whole: it resumes.
    resumed = _train(cfg, "--resume", run, "--max-steps", steps[-1] + 1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_two_nodes_on_one_host(tmp_path):
    """Multi-node through torchrun's own rendezvous (README, "More than one GPU"): two launchers,
    one process each, node ranks 0 and 1, meeting at one address. Same losses as one process."""
    import socket

    cfg = _config(tmp_path, steps=3, save_every=0)
    one = tmp_path / "one"
    assert _train(cfg, "--output", one).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    run = tmp_path / "nodes"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={k}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "engine",
                "train",
                str(cfg),
                "--output",
                str(run),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    l1, l2 = _losses(one), _losses(run)
    assert sorted(l2) == [1, 2, 3]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5)
