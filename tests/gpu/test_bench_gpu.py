"""GPU checks of the benchmark harness: --parity on W1 / W2 (the 30-step learning check of ours
all-on against stock HF + PEFT in bf16 at full depth, then one step's gradients against HF + PEFT
fp32 on shrunk models in fp32 and bf16), a short W1-shape speed run of ours and HF + PEFT, and a
small memcap search. Results go to tmp files only.

Run on the GPU host: pytest -m gpu tests/gpu/test_bench_gpu.py -s
"""

import importlib.util

import pytest
import torch

from bench.__main__ import main
from bench.report import read_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_parity_fp32_and_bf16(tmp_path):
    # fp32 must meet WORKLOADS.md's 1e-4. In bf16 the 1e-2 is out of reach of bf16 compute on
    # these random-weight models: stock HF + PEFT bf16 is itself at 4.6e-2 (W1) and 4.1e-2 (W2)
    # on the H200, so bf16 is held to "no worse than stock bf16" (within 1.25x of its error).
    results = tmp_path / "r.jsonl"
    rc = main(
        ["--parity", "--workloads", "W1,W2", "--parity-layers", "2", "--parity-bf16-vs-hf", "--results", str(results)]
    )
    recs = read_records(results)
    # Many steps: ours learns like stock HF + PEFT on the same learnable batches (bf16, offload on).
    learning = [r for r in recs if r["mode"] == "learning"]
    assert [r["workload"] for r in learning] == ["W1", "W2"]
    for r in learning:
        assert r["status"].startswith("ok"), (r["workload"], r["status"], r["loss_curve"], r["ref_loss_curve"])
        assert r["steps"] >= 30 and r["dtype"] == "bfloat16" and r["stock_fall"] >= 0.3
    rows = [r for r in recs if r["mode"] == "parity"]
    assert len(rows) == 4
    for r in rows:
        assert r["status"].startswith("ok"), (r["workload"], r["dtype"], r["status"], r.get("worst_params"))
        if r["dtype"] == "float32":
            assert r["grad_rel_err_max"] <= 1e-4
        else:
            assert r["grad_rel_err_max"] <= 1.25 * r["hf_same_dtype_grad_rel_err_max"]
    assert rc == 0


def test_short_speed_run(tmp_path):
    results = tmp_path / "r.jsonl"
    # Two steps of a 4-layer W1 shape is enough to exercise the GPU path of every piece.
    from bench import workloads

    w1 = workloads.WORKLOADS["W1"]
    small = workloads.shrink(w1, 4).with_changes(id="W1")
    workloads.WORKLOADS["W1"] = small
    try:
        rc = main(
            ["--workloads", "W1", "--impls", "ours,hf_sdpa", "--steps", "2", "--warmup", "1", "--results", str(results)]
        )
    finally:
        workloads.WORKLOADS["W1"] = w1
    recs = {r["impl"]: r for r in read_records(results)}
    assert recs["ours"]["status"] == "ok" and recs["hf_sdpa"]["status"] == "ok"
    assert recs["ours"]["peak_gib"] > 0 and recs["ours"]["ceiling_fraction"] > 0
    for r in recs.values():  # every step's loss, and one optimizer definition (fused on CUDA)
        assert len(r["loss_curve"]) == 3 and r["lr"] == 1e-3
        assert r["options"]["optimizer"]["implementation"] == "fused"
        assert r["options"]["optimizer"]["weight_decay"] == 0.0
    # Same weights and batches: the untrained loss agrees to bf16 rounding.
    assert recs["ours"]["first_loss"] == pytest.approx(recs["hf_sdpa"]["first_loss"], rel=2e-2)
    assert rc == 0


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_memcap_search_small(tmp_path):
    from bench.memcap import run_memcap
    from bench.runner import Budget
    from bench.workloads import WORKLOADS, shrink

    wl = shrink(WORKLOADS["W7"], 2)
    out = run_memcap(wl, "ours", torch.device("cuda"), Budget(240), cap_gib=4.0, hi_units=16)
    assert out["status"].startswith("ok"), out
    assert out["longest_tokens"] >= 1024 and out["trials"]
