"""W10's learning check (bench.dpo_check) on the curves of the H200 run of 2026-12-02 (489a924):
ours passes at the run's noise floor, and curves that do not learn like DPO fail."""

from __future__ import annotations

import pytest

from bench.dpo_check import dpo_check, mean_abs_gap
from bench.report import learning_verdict

# bench/results/results.jsonl, run of 489a924: W10 on one H200, bf16, lr 1e-3, 11 steps each
OURS = [0.6931, 0.6298, 0.4957, 0.3733, 0.288, 0.2213, 0.3019, 0.1985, 0.0628, 0.092, 0.0099]
TRL = [0.6931, 0.6188, 0.5163, 0.408, 0.2555, 0.1762, 0.2814, 0.1795, 0.0929, 0.1032, 0.0115]
LIGER_VARLEN = [0.6931, 0.6011, 0.4557, 0.4028, 0.2261, 0.2097, 0.3483, 0.137, 0.0632, 0.1867, 0.0073]
TRL_LIGER = [0.6931, 0.588, 0.5141, 0.3744, 0.2567, 0.2591, 0.2982, 0.2047, 0.0667, 0.0866, 0.0158]
PEERS = {"liger_dpo_varlen": LIGER_VARLEN, "trl_dpo_liger": TRL_LIGER}


def test_the_measured_curve_passes_at_the_runs_noise_floor():
    c = dpo_check(OURS, TRL, PEERS)
    assert c["verdict"] == "ok", c["reason"]
    assert c["floor_impl"] == "liger_dpo_varlen"
    assert c["mean_abs_gap"] < c["floor"]


def test_a_curve_that_does_not_fall_fails():
    # the reference computed with the adapters on: policy == reference, the loss stays at log 2
    flat = [0.6931] * len(TRL)
    c = dpo_check(flat, TRL, PEERS)
    assert c["verdict"] == "FAILED" and "fell" in c["reason"]


def test_a_curve_farther_from_trl_than_every_peer_fails():
    # falls like TRL at the end, but on a different path (e.g. twice the beta early on)
    off = [TRL[0]] + [max(0.0, x - 0.12) for x in TRL[1:-3]] + TRL[-3:]
    assert mean_abs_gap(off, TRL) > mean_abs_gap(LIGER_VARLEN, TRL)
    c = dpo_check(off, TRL, PEERS)
    assert c["verdict"] == "FAILED" and "mean distance" in c["reason"]


def test_without_other_implementations_the_strict_rule_applies():
    c = dpo_check(OURS, TRL, {})
    assert c["verdict"] == "FAILED" and "%" in c["reason"]
    assert c["rule"].startswith("strict")


def test_mean_abs_gap_refuses_curves_of_different_lengths():
    with pytest.raises(ValueError):
        mean_abs_gap(OURS, TRL[:-1])


def test_the_summary_uses_the_dpo_check_for_w10_records():
    def rec(impl, curve):
        return {"workload": "W10", "impl": impl, "run_id": "r1", "gpu": "g", "status": "ok", "loss_curve": curve}

    records = [rec("ours", OURS), rec("trl_dpo", TRL)] + [rec(n, c) for n, c in PEERS.items()]
    verdicts = {r["impl"]: learning_verdict(r, records) for r in records}
    assert verdicts["ours"]["verdict"] == "ok" and verdicts["ours"]["counts"]
    assert verdicts["trl_dpo"]["verdict"] == "reference"
    assert "fall only" in verdicts["trl_dpo_liger"]["reason"]
