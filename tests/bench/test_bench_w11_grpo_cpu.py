"""W11 (GRPO on Qwen3-1.7B) through the harness on a CPU at CPU-tiny's width with Qwen3's vocabulary:
the prompts are rendered to the same ids TRL renders, ours (the engine's GRPO objective) and TRL's
GRPOTrainer both sample, score with W11's rewards (which vary on random text) and update, and the
records carry completions/s and the reward, spread, KL and completion-length curves that the
learning check (bench.grpo_bench.grpo_check) reads; the check passes on the pair and fails when
ours does not move or moves against the reward. The tokenizer is the conformance cache's Qwen3
one (built from llama.cpp's upstream vocabulary). No wall-clock assertions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from bench.grpo_bench import grpo_check, load_tokenizer, prompt_texts, reward_configs
from bench.method_batches import make_method_batches, method_rates
from bench.report import learning_verdict
from bench.runner import Budget, Context, run_impl, setup_for
from bench.workloads import WORKLOADS, tiny_method
from tests.conformance.families import build_family_folder

W11 = WORKLOADS["W11"]
TINY = tiny_method(W11, prompts=2, group=4, max_new_tokens=8, prompt_mean=8, max_tokens=16)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/bench/conftest.py


@pytest.fixture(scope="module")
def args():
    return SimpleNamespace(tokenizer=str(build_family_folder("qwen3")))


def _run(impl, batches, args, steps=3):
    options = {"variant": "all-on"} if impl == "ours" else {}
    ctx = Context(TINY, batches, torch.device("cpu"), 1, steps, Budget(None), args, lr=1e-2)
    rec = run_impl(setup_for(impl, options), ctx, impl, {"run_id": "t", "gpu": "cpu"}, options)
    rec.update(method_rates(TINY, rec))
    return rec


def test_w11_rewards_vary_on_random_text_and_prompts_render_as_trl_renders(args):
    tok = load_tokenizer(args)
    assert len(tok) >= 151_643  # Qwen3's vocabulary
    length, digit = reward_configs(W11)
    assert (length.kind, length.max_chars, digit.kind) == ("length", 1280, "regex")
    step = make_method_batches(TINY, 1)[0]
    texts = prompt_texts(step, tok)
    assert len(texts) == 2 and all(texts)
    from bench.ours_methods import _run_config, grpo_prompts
    from engine.train.objectives.grpo import GRPO

    objective = GRPO(_run_config(TINY))
    (batch,) = grpo_prompts(TINY, objective, tok, [step])
    ours_ids = [batch.data.examples[i][0] for i in batch.example_ids]
    from bench.peers.trl_grpo import TrlGrpoPeer

    peer = TrlGrpoPeer(TINY, torch.device("cpu"), 1e-2, tok)
    inputs = peer.inputs(texts)
    assert [x["prompt"][0]["content"] for x in inputs] == [t for t in texts for _ in range(4)]  # each prompt x group
    trl_ids, _, _ = peer.trainer._tokenize_prompts([x["prompt"] for x in inputs[::4]])  # TRL's own rendering
    assert ours_ids == [list(x) for x in trl_ids]
    assert max(max(ids) for ids in ours_ids) < W11.config["vocab_size"]


def test_w11_tiny_ours_and_trl_grpo_train_and_pass_the_check(args):
    batches = make_method_batches(TINY, 4)
    ours = _run("ours", batches, args)
    assert ours["status"] == "ok", ours["status"]
    assert ours["options"]["objective"] == "engine.train.objectives.grpo.GRPO"
    trl = _run("trl_grpo", batches, args)
    assert trl["status"] == "ok", trl["status"]
    assert trl["options"]["trainer"].startswith("trl.GRPOTrainer") and trl["options"]["use_vllm"] is False
    for rec in (ours, trl):
        assert rec["completions_per_step"] == 8 and rec["completions_per_s"] > 0
        for key in ("loss_curve", "reward_curve", "reward_std_curve", "kl_curve", "completion_length_curve"):
            assert len(rec[key]) == 4 and all(math.isfinite(x) for x in rec[key]), (rec["impl"], key)
        # The adapter starts at zero: the policy is the reference at the first step, then it moves.
        assert rec["kl_curve"][0] == pytest.approx(0.0, abs=1e-6) and rec["kl_curve"][-1] > 1e-6, rec["impl"]
        assert all(s > 0 for s in rec["reward_std_curve"]), rec["impl"]  # the rewards give a signal
        assert all(0 < n <= 8 for n in rec["completion_length_curve"])
    check = grpo_check(ours, trl)
    assert check["verdict"] == "ok", check["reason"]
    verdict = learning_verdict(ours, [ours, trl])
    assert verdict["verdict"] == "ok" and verdict["counts"], verdict
    assert learning_verdict(trl, [ours, trl])["verdict"] == "reference"

    # The check fails for a policy that did not move, and for one that moved against the reward.
    still = dict(ours, kl_curve=[0.0] * 4)
    assert grpo_check(still, trl)["verdict"] == "FAILED"
    base = [0.1, 0.1, 0.1, 0.1]
    rising = dict(trl, reward_curve=[0.0, 0.01, 0.5, 0.51])
    falling = dict(ours, reward_curve=[0.5, 0.51, 0.0, 0.01])
    assert grpo_check(falling, rising)["verdict"] == "FAILED"
    assert grpo_check(dict(ours, reward_curve=base), dict(trl, reward_curve=base))["verdict"] == "ok"
    flat = dict(ours, reward_std_curve=[0.1, 0.0, 0.1, 0.1])
    assert "no reward spread" in grpo_check(flat, trl)["reason"]


def test_w11_without_a_tokenizer_says_how_to_provide_one(tmp_path):
    batches = make_method_batches(TINY, 2)
    rec = _run("ours", batches, SimpleNamespace(tokenizer=str(tmp_path)), steps=1)
    assert rec["status"].startswith("not supported") and ".gpu/qwen-tokenizer" in rec["status"], rec["status"]


def test_w11_dry_run_names_its_tokenizer_and_rewards(args, tmp_path, capsys):
    from bench.__main__ import main

    common = ["--workloads", "W11", "--impls", "ours,trl_grpo", "--dry-run", "--results", str(tmp_path / "r.jsonl")]
    assert main([*common, "--tokenizer", args.tokenizer]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer: {args.tokenizer}" in out and "rewards: length" in out and "impls: ours, trl_grpo" in out
    assert main([*common, "--tokenizer", str(tmp_path)]) == 0
    assert "tokenizer: MISSING" in capsys.readouterr().out
