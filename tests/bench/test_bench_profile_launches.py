"""`--profile` on a CPU: every profiled record carries the launch and host-time fields per step, and
`--ours-variants all-on,add_rmsnorm=false` gives the before/after pair of the fused add + RMSNorm in
one run (on a CPU nothing is launched, so the kernel lists are empty; the GPU fills them)."""

from __future__ import annotations

from bench.__main__ import main
from bench.profile import LAUNCH_CALLS, launch_counts
from bench.report import read_records


def test_profile_records_launches_and_host_time_per_step(tmp_path, one_thread):
    results = tmp_path / "results.jsonl"
    argv = ["--cpu-smoke", "--impls", "ours", "--ours-variants", "all-on,add_rmsnorm=false", "--profile"]
    assert main(argv + ["--results", str(results)]) == 0
    recs = [r for r in read_records(results) if r["mode"] == "bench"]
    by_variant = {r["options"]["variant"]: r for r in recs}
    assert set(by_variant) == {"all-on", "add_rmsnorm=false"}
    for r in by_variant.values():
        assert r["status"] == "ok", r["status"]
        assert len(r["host_cpu_ms"]) == len(r["step_wall_ms"]) == 2
        assert all(h > 0 for h in r["host_cpu_ms"]) and all(w > 0 for w in r["step_wall_ms"])
        assert r["kernel_launches"] == [] and r["launch_calls"] == []  # a CPU launches no kernels
        assert r["profile_wall_ms"] > 0 and r["profile_gpu_ms"] == 0
    assert by_variant["all-on"]["options"]["fast_paths_report"]["add_rmsnorm"] == "on"
    assert (
        by_variant["add_rmsnorm=false"]["options"]["fast_paths_report"]["add_rmsnorm"]
        == "off: fast_paths.add_rmsnorm is false"
    )


def test_profile_stacks_name_the_line_that_ran_each_op(tmp_path, one_thread, capsys):
    """--profile-stacks: the ops outside the matmuls, each with its input shapes and a stack frame
    in our code (on a CPU by CPU time)."""
    results = tmp_path / "results.jsonl"
    argv = ["--cpu-smoke", "--impls", "ours", "--profile", "--profile-stacks", "--results", str(results)]
    assert main(argv) == 0
    err = capsys.readouterr()
    text = err.out + err.err
    assert "torch ops outside the matmuls by CPU time, with stacks" in text
    table = text.split("torch ops outside the matmuls by CPU time, with stacks", 1)[1]
    rows = [line for line in table.splitlines() if " ms  x" in line]
    assert rows and not any(" aten::mm " in r or " aten::addmm " in r for r in rows)
    assert "shapes [[" in rows[0]
    assert "engine/" in table  # frames point into the engine's own files


def test_launch_counts_of_a_cpu_profile_are_zero():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    assert launch_counts(prof.events()) == (0, 0, 0)
    assert "cudaLaunchKernel" in LAUNCH_CALLS and "cuLaunchKernel" in LAUNCH_CALLS


def test_a_backward_op_is_named_by_its_node_and_the_forward_line_it_differentiates(one_thread):
    """An op that autograd runs in the backward has no Python frame of its own on a GPU (the engine's
    thread); the table names its node and the frames of the forward op the node came from."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.profile import _stack_table

    x = torch.randn(64, 32, requires_grad=True)

    def squash(t):
        return torch.tanh(t)  # the forward line the backward's tanh_backward must point to

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        squash(x).sum().backward()
    table = _stack_table(prof, cuda=False, top=50)
    rows = table.splitlines()
    at = next(i for i, r in enumerate(rows) if "aten::tanh_backward" in r)
    assert rows[at + 1].strip() == "backward of TanhBackward0"
    assert "squash" in rows[at + 2] and "test_bench_profile_launches.py" in rows[at + 2]
    forward = next(i for i, r in enumerate(rows) if " aten::tanh " in r)
    assert "squash" in rows[forward + 1]  # the forward op keeps its own frames
