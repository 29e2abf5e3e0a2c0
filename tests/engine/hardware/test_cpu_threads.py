"""engine.hardware.threads: torch's CPU threads for a run are sized to the cores the process may
use, one left free, shared among local ranks; OMP_NUM_THREADS is kept (issue 28, item 9)."""

from __future__ import annotations

import os

from engine.hardware.threads import apply_cpu_threads, choose_cpu_threads, usable_cores


def test_the_choice_leaves_one_core_and_shares_among_ranks():
    assert choose_cpu_threads(2).threads == 1
    assert choose_cpu_threads(1).threads == 1
    assert choose_cpu_threads(16).threads == 15
    assert choose_cpu_threads(16, local_ranks=4).threads == 3
    assert choose_cpu_threads(2, local_ranks=2).threads == 1
    kept = choose_cpu_threads(16, env_threads="6")
    assert kept.threads == 6 and "OMP_NUM_THREADS=6" in kept.reason
    assert choose_cpu_threads(4, env_threads="junk").threads == 3


def test_usable_cores_follow_the_affinity_mask():
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))


def test_a_cpu_run_sets_torchs_pool(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        choice = apply_cpu_threads("cpu")
        assert choice is not None
        assert torch.get_num_threads() == choice.threads == max(1, usable_cores() - 1)
    finally:
        torch.set_num_threads(before)
