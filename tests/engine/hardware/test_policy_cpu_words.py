"""The hardware policy's reason for training.distributed on a CPU says what happens there (issue 28
item 10: it said 'each GPU holds it' on a machine without one)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.hardware import policy


def test_distributed_on_a_cpu_says_one_process():
    budget = policy.Budget(False, 8 * 2**30, 16 * 2**30, 12 * 2**30, "RAM", "cpu")
    small = SimpleNamespace(num_params=135_000_000)
    for info, four_bit in ((small, False), (None, False), (small, True)):
        value, reason = policy.distributed_default(budget, info, four_bit)
        assert value == "ddp"  # a valid value; one process ignores it
        assert "GPU holds" not in reason and "CPU" in reason and "one process" in reason


def test_distributed_on_a_gpu_still_explains_ddp():
    budget = policy.Budget(True, 80 * 2**30, 96 * 2**30, 90 * 2**30, "VRAM", "datacenter")
    value, reason = policy.distributed_default(budget, SimpleNamespace(num_params=8_000_000_000), False)
    assert value == "ddp" and "each GPU holds" in reason
