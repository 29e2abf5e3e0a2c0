"""W10 (DPO on Qwen3-8B pairs) and W11 (GRPO on Qwen3-1.7B) through the harness on a CPU at
CPU-tiny's shape: the workloads are listed with WORKLOADS.md's settings, their data is the same
for every implementation and learnable (the chosen answer continues the chain, the rejected one
does not), ours (the engine's DPO objective) and TRL's DPOTrainer train the same pairs along the
same loss curve from log 2, and record pairs/s; the CUDA-only peer (Liger's fused DPO loss on varlen flash
attention) says why it cannot run here, and its packing of the pairs is checked on the host.
No wall-clock assertions."""

from __future__ import annotations

import math

import pytest
import torch

from bench.batches import chain
from bench.method_batches import make_method_batches, method_rates
from bench.runner import Budget, Context, run_impl, setup_for
from bench.workloads import WORKLOADS, tiny_method

W10, W11 = WORKLOADS["W10"], WORKLOADS["W11"]
TINY = tiny_method(W10, pairs=2, prompt_mean=12, answer_mean=16, max_tokens=64)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/bench/conftest.py


def _run(impl: str, batches, workload=TINY, steps=2) -> dict:
    options = {"variant": "all-on"} if impl == "ours" else {}
    ctx = Context(workload, batches, torch.device("cpu"), 1, steps, Budget(None), None, lr=1e-2)
    rec = run_impl(setup_for(impl, options), ctx, impl, {}, options)
    rec.update(method_rates(workload, rec))
    return rec


def test_w10_and_w11_are_listed_with_their_settings():
    assert W10.kind == "dpo" and W10.config == WORKLOADS["W3"].config  # Qwen3-8B's shape
    assert W10.extra == dict(pairs=16, prompt_mean=256, answer_mean=384, max_tokens=1024, beta=0.1)
    assert W11.kind == "grpo" and W11.config["hidden_size"] == 2048 and W11.config["num_hidden_layers"] == 28
    assert (W11.extra["prompts"], W11.extra["group"], W11.extra["max_new_tokens"]) == (8, 8, 256)


def test_w10_pairs_are_the_same_for_everyone_and_learnable():
    a, b = make_method_batches(W10, 2), make_method_batches(W10, 2)
    assert [s.pairs for s in a] == [s.pairs for s in b]  # rebuilt from numbers alone
    step = a[0]
    assert step.num_pairs == 16 and a[0].pairs != a[1].pairs
    c = chain(W10.config["vocab_size"])
    succ = {int(c.symbols[i]): int(c.symbols[c.succ[i]]) for i in range(len(c.symbols))}

    def follows(seq):  # how often a token is the chain's successor of the one before
        return sum(succ[x] == y for x, y in zip(seq, seq[1:])) / (len(seq) - 1)

    for prompt, chosen, rejected in step.pairs:
        assert len(prompt) + max(len(chosen), len(rejected)) <= 1024
        assert follows(prompt + chosen) > 0.5 and follows(rejected) < 0.1
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert 150 < mean([len(p) for s in a for p, _, _ in s.pairs]) < 400
    assert 250 < mean([len(c) for s in a for _, c, _ in s.pairs]) < 550


def test_w10_tiny_ours_and_trl_dpo_train_the_same_pairs():
    batches = make_method_batches(TINY, 3)
    ours = _run("ours", batches)
    assert ours["status"] == "ok", ours["status"]
    assert ours["options"]["objective"] == "engine.train.objectives.dpo.DPO"
    trl = _run("trl_dpo", batches)
    assert trl["status"] == "ok", trl["status"]
    assert trl["options"]["trainer"].startswith("trl.DPOTrainer")
    for rec in (ours, trl):
        curve = rec["loss_curve"]
        assert len(curve) == 3 and all(math.isfinite(x) for x in curve)
        # The adapter starts at zero: policy and reference agree, the DPO loss is log 2.
        assert curve[0] == pytest.approx(math.log(2), abs=1e-5), rec["impl"]
        assert rec["pairs_per_step"] == 2 and rec["pairs_per_s"] > 0
    # Same weights, LoRA, pairs, loss and optimizer, fp32: the same curve step by step (the
    # learning check of a GPU run holds ours to this curve, bench.report.REFERENCE_IMPLS).
    assert ours["loss_curve"] == pytest.approx(trl["loss_curve"], rel=1e-3)
    assert ours["loss_curve"][1] != ours["loss_curve"][0]  # the step updated something


def test_cuda_only_peers_say_why_they_do_not_run_here():
    # W11 (GRPO) runs on a CPU too: tests/bench/test_bench_w11_grpo_cpu.py.
    batches = make_method_batches(TINY, 2)
    for impl in ("liger_dpo_varlen", "trl_dpo_liger"):
        rec = _run(impl, batches, steps=1)
        assert rec["status"].startswith("not supported") and "CUDA" in rec["status"], (impl, rec["status"])


def test_liger_peer_packs_pairs_chosen_first_with_answer_targets():
    from bench.peers.liger_dpo import packed_pairs

    step = make_method_batches(TINY, 1)[0]
    inp = packed_pairs(step)
    ids = inp["input_ids"][0]
    docs = [p + c for p, c, _ in step.pairs] + [p + r for p, _, r in step.pairs]
    assert ids.numel() == step.num_tokens == sum(map(len, docs))
    assert inp["varlen"]["cu_seq_lens_q"].tolist()[-1] == ids.numel()
    for d, (doc, (prompt, *_)) in enumerate(zip(docs, step.pairs + step.pairs)):
        n = len(doc)
        assert ids[inp["index"][d, :n]].tolist() == doc
        assert inp["position_ids"][0, inp["index"][d, :n]].tolist() == list(range(n))
        targets = inp["targets"][d]
        answer = doc[len(prompt) :]
        assert targets[len(prompt) - 1 : n - 1].tolist() == answer  # each answer token, predicted once
        assert (targets[: len(prompt) - 1] == -100).all() and (targets[n - 1 :] == -100).all()
