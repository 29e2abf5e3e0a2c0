"""The benchmark harness on a CPU: the --cpu-smoke run end to end (ours + HF + PEFT, then fp32
parity) through `engine.bench.__main__.main`, plus the pieces the GPU run relies on (batches,
the 6N ceiling, the memcap search, the patch guard), all writing only to tmp files."""

from __future__ import annotations

import json

import pytest
import torch

from engine.bench.__main__ import main
from engine.bench.batches import MAX_LEN, MIN_LEN, make_batches, make_step
from engine.bench.memcap import search_longest
from engine.bench.report import DEFAULT_RESULTS, read_records
from engine.bench.workloads import WORKLOADS, ceiling_tokens_per_s, count_matmul_params, make_config, matmul_params


def _results_state():
    return DEFAULT_RESULTS.stat().st_mtime_ns if DEFAULT_RESULTS.exists() else None


def test_cpu_smoke_end_to_end(tmp_path, capsys):
    before = _results_state()
    results = tmp_path / "results.jsonl"
    assert main(["--cpu-smoke", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "workload" in out.splitlines()[-3] or "CPU-tiny" in out  # the table is printed

    recs = read_records(results)
    bench = {r["impl"]: r for r in recs if r["mode"] == "bench"}
    assert set(bench) == {"ours", "hf_sdpa"}
    for r in bench.values():
        assert r["status"] == "ok", r["status"]
        assert r["workload"] == "CPU-tiny" and r["tokens_per_s"] > 0
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert len(r["step_times"]) == 2 and len(r["losses"]) == 3
        for key in ("date", "commit", "gpu", "versions", "options", "step_s", "peak_gib", "reserved_gib",
                    "first_loss", "last_loss", "ceiling_fraction"):
            assert key in r, key
    # Same weights, same batches, same targets: the two implementations see the same first loss.
    assert bench["ours"]["first_loss"] == pytest.approx(bench["hf_sdpa"]["first_loss"], rel=1e-4)
    assert bench["ours"]["options"]["fast_paths_report"]  # prepare_model's report is recorded
    assert bench["ours"]["offload_step"] == "double"  # what the last timed step's offload did

    parity = [r for r in recs if r["mode"] == "parity"]
    assert len(parity) == 1 and parity[0]["dtype"] == "float32"
    assert parity[0]["status"] == "ok", parity[0]["status"]
    assert parity[0]["grad_rel_err_max"] <= 1e-4 and parity[0]["n_grads"] > 0

    md = tmp_path / "RESULTS.md"
    assert main(["--summarize", "--results", str(results), "--md", str(md)]) == 0
    text = md.read_text()
    assert "CPU-tiny" in text and "| ours |" in text and "Parity" in text
    assert _results_state() == before  # the repository's results.jsonl is never touched by tests


def test_merge_appends_only_new_records(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rec = {"mode": "bench", "workload": "W1", "impl": "ours", "status": "ok", "tokens_per_s": 1.0}
    a.write_text(json.dumps(rec) + "\n")
    b.write_text(json.dumps(rec) + "\n" + json.dumps(dict(rec, impl="hf_sdpa")) + "\n")
    assert main(["--summarize", "--merge", str(b), "--results", str(a), "--md", str(tmp_path / "R.md")]) == 0
    assert [r["impl"] for r in read_records(a)] == ["ours", "hf_sdpa"]


def test_summary_shows_the_newest_record_by_date_not_by_file_order(tmp_path):
    # A merge can append an older call's records after a newer run's.
    a = tmp_path / "a.jsonl"
    rec = {"mode": "bench", "workload": "W1", "impl": "ours", "status": "ok", "gpu": "G", "commit": "c"}
    newer = dict(rec, date="2026-11-29T11:27:00+00:00", tokens_per_s=222_222.0)
    older = dict(rec, date="2026-11-29T11:14:00+00:00", tokens_per_s=111_111.0)
    a.write_text(json.dumps(newer) + "\n" + json.dumps(older) + "\n")
    md = tmp_path / "R.md"
    assert main(["--summarize", "--results", str(a), "--md", str(md)]) == 0
    text = md.read_text()
    assert "222,222" in text and "111,111" not in text


def test_ceiling_reproduces_workloads_md():
    # WORKLOADS.md: ~219k tokens/s on W1 and ~106k on W2 (N = matmul parameters incl. LM head).
    assert ceiling_tokens_per_s(WORKLOADS["W1"]) == pytest.approx(219_000, rel=0.02)
    assert ceiling_tokens_per_s(WORKLOADS["W2"]) == pytest.approx(106_000, rel=0.02)
    # Its ~16.1k on W3 also counts the untied input embedding (all parameters); ours does not.
    w3 = WORKLOADS["W3"]
    all_params = matmul_params(w3) + w3.config["vocab_size"] * w3.config["hidden_size"]
    assert 790e12 / (6 * all_params) == pytest.approx(16_100, rel=0.01)


@pytest.mark.parametrize("wid", ["W1", "W2", "W3"])
def test_matmul_params_match_the_built_model(wid):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(WORKLOADS[wid]))
    assert count_matmul_params(model) == matmul_params(WORKLOADS[wid])


def test_batches_follow_the_recipe():
    a = make_batches(4, 16_384, 151_936)
    b = make_batches(4, 16_384, 151_936)
    for x, y in zip(a, b):  # a fresh seed per step, identical in every process
        assert x.lengths == y.lengths and torch.equal(x.ids, y.ids)
    assert a[0].lengths != a[1].lengths
    for s in a:
        assert sum(s.lengths) == 16_384 and s.num_tokens == 16_384
        assert all(MIN_LEN <= n <= MAX_LEN for n in s.lengths[:-1]) and 1 <= s.lengths[-1] <= MAX_LEN
        assert int(s.ids.max()) < 151_936
    single = make_step(1, 32_768, 128_256, packing="single")
    assert single.lengths == [32_768]


def test_hf_labels_train_the_engines_targets():
    from engine.data.collate import PackedBatch

    s = make_step(3, 2048, 1000)
    pb = PackedBatch.from_documents(s.documents())
    hf = s.hf_inputs()
    shifted = torch.nn.functional.pad(hf["labels"], (0, 1), value=-100)[:, 1:]  # what HF's loss does
    assert torch.equal(shifted, pb.targets)
    assert torch.equal(hf["position_ids"][0], pb.info.position_ids)
    assert s.num_trained_tokens == pb.num_trained_tokens


def test_memcap_binary_search():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 40_000

    longest, trials = search_longest(fits, 1, 128)
    assert longest == 39 * 1024 and len(trials) == len(calls) <= 8
    assert search_longest(lambda n: False, 1, 128)[0] == 0
    assert search_longest(lambda n: True, 1, 128)[0] == 128 * 1024


def test_patch_guard_restores_transformers():
    from transformers.models.qwen3 import modeling_qwen3

    from engine.bench.runner import PatchGuard

    rope, forward = modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3MLP.forward
    with PatchGuard("qwen3"):
        modeling_qwen3.apply_rotary_pos_emb = lambda *a, **k: None
        modeling_qwen3.Qwen3MLP.forward = lambda self, x: x
    assert modeling_qwen3.apply_rotary_pos_emb is rope
    assert modeling_qwen3.Qwen3MLP.forward is forward


def test_variants_and_unsupported_switches():
    from engine.bench.ours import fast_path_config, split_fields, variant_fields
    from engine.bench.runner import NotYetSupported

    # every variant is a change from all-on, which offloads with a double buffer
    assert variant_fields("all-on") == {"offload": "double"}
    assert variant_fields("no-fused-ce") == {"offload": "double", "fused_ce": False}
    assert variant_fields("kernels=false+ce_chunk_tokens=4096") == {
        "offload": "double", "kernels": False, "ce_chunk_tokens": 4096}
    assert fast_path_config(variant_fields("rebuilt-metadata")).cached_metadata is False
    with pytest.raises(NotYetSupported):
        fast_path_config(variant_fields("no-such-switch=1"))
    # offload is a training setting, passed beside the fast-path switches
    assert split_fields(variant_fields("offload-single")) == ({}, {"offload": "single"})
    assert split_fields(variant_fields("no-offload")) == ({}, {"offload": "off"})


def test_dry_run_builds_nothing(capsys):
    assert main(["--dry-run", "--workloads", "W1,W5,W7", "--results", "/nonexistent/x.jsonl"]) == 0
    out = capsys.readouterr().out
    assert "W1 Qwen3-0.6B" in out and "hf_moe_eager" in out and "memcap" in out
