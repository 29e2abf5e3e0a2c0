"""W9 (the whole Qwen3-MoE model, LoRA on attention, experts frozen) through the harness on a
CPU at a tiny shape: the workload is listed and planned (hf_sdpa built with transformers'
grouped_mm experts), ours and the HF + PEFT peers each run a full training step on the same
batches and start from the same loss, or a peer says why it cannot run here. No wall-clock
assertions."""

from __future__ import annotations

import math

import pytest
import torch

from bench.__main__ import main, plan_impls
from bench.batches import make_batches
from bench.peers.moe import available_experts_impls
from bench.runner import Budget, Context, run_impl, setup_for
from bench.workloads import WORKLOADS, tiny_moe

W9 = WORKLOADS["W9"]
TINY = tiny_moe(W9)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/bench/conftest.py


def _run(impl: str, options: dict, batches) -> dict:
    ctx = Context(TINY, batches, torch.device("cpu"), 1, 2, Budget(None), None, lr=1e-2)
    return run_impl(setup_for(impl, options), ctx, impl, {}, options)


def test_w9_is_listed_and_planned(capsys):
    assert W9.kind == "train" and W9.arch == "qwen3_moe" and W9.config["num_hidden_layers"] == 48
    assert W9.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")  # experts frozen
    plan = plan_impls(W9, ["ours", "hf", "hf_experts_eager"], ["all-on"])
    assert plan == [
        ("ours", {"variant": "all-on"}),
        ("hf_sdpa", {"experts_implementation": "grouped_mm"}),
        ("hf_experts_eager", {}),
    ]
    assert main(["--dry-run", "--workloads", "W9", "--impls", "ours,hf", "--results", "/nonexistent/x.jsonl"]) == 0
    out = capsys.readouterr().out
    assert "W9 Qwen3-30B-A3B" in out and "hf_sdpa[grouped_mm experts]" in out


def test_w9_tiny_ours_and_hf_peers_train_the_whole_model():
    batches = make_batches(3, TINY.tokens, TINY.config["vocab_size"])
    ours = _run("ours", {"variant": "all-on"}, batches)
    assert ours["status"] == "ok", ours["status"]
    assert ours["options"]["fast_paths_report"]["moe_grouping"] == "on"  # every MoE block grouped
    assert len(ours["loss_curve"]) == 3 and all(math.isfinite(x) for x in ours["loss_curve"])

    for impl, options, experts in (
        ("hf_sdpa", {"experts_implementation": "grouped_mm"}, "grouped_mm"),
        ("hf_experts_eager", {}, "eager"),
    ):
        rec = _run(impl, options, batches)
        if experts not in available_experts_impls():  # an older transformers says why
            assert rec["status"].startswith("not supported") and experts in rec["status"], rec["status"]
            continue
        assert rec["status"] == "ok", (impl, rec["status"])
        assert rec["options"]["experts_implementation"] == experts
        assert rec["options"]["attn_implementation"] == "sdpa"
        curve = rec["loss_curve"]
        assert len(curve) == 3 and all(math.isfinite(x) for x in curve)
        # Same weights, batches and targets: the same loss before any update.
        assert curve[0] == pytest.approx(ours["loss_curve"][0], rel=1e-3), impl


def test_experts_peer_refuses_a_dense_workload():
    batches = make_batches(1, 64, 256)
    from bench.workloads import CPU_TINY

    ctx = Context(CPU_TINY, batches, torch.device("cpu"), 0, 1, Budget(None), None)
    rec = run_impl(setup_for("hf_experts_eager", {}), ctx, "hf_experts_eager", {}, {})
    assert rec["status"].startswith("not supported") and "MoE" in rec["status"]
