"""The benchmark harness on a CPU: the --cpu-smoke run end to end (ours + HF + PEFT, fp32
parity, the 30-step learning check) through `bench.__main__.main`, plus the pieces the
GPU run relies on (learnable batches, the learning check and the summary's rules, the 6N
ceiling, the memcap search, the patch guard), all writing only to tmp files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.__main__ import main
from bench.batches import MAX_LEN, MIN_LEN, chain, make_batches, make_step
from bench.memcap import search_longest
from bench.report import DEFAULT_RESULTS, best_peer_same_run, learning_check, learning_verdict, read_records
from bench.workloads import WORKLOADS, ceiling_tokens_per_s, count_matmul_params, make_config, matmul_params


def _results_state():
    return DEFAULT_RESULTS.stat().st_mtime_ns if DEFAULT_RESULTS.exists() else None


def test_cpu_smoke_end_to_end(tmp_path, capsys):
    before = _results_state()
    results = tmp_path / "results.jsonl"
    assert main(["--cpu-smoke", "--results", str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The console table: its header, then one row per implementation of this run.
    head = next(i for i, ln in enumerate(lines) if ln.startswith("workload ") and "learning" in ln)
    assert lines[head + 2].split()[:3] == ["CPU-tiny", "ours", "ok"]
    assert lines[head + 3].split()[:3] == ["CPU-tiny", "hf_sdpa", "ok"]
    assert any(ln.startswith("LEARNING CHECK CPU-tiny") and ": ok:" in ln for ln in lines)

    recs = read_records(results)
    bench = {r["impl"]: r for r in recs if r["mode"] == "bench"}
    assert set(bench) == {"ours", "hf_sdpa"}
    for r in bench.values():
        assert r["status"] == "ok", r["status"]
        assert r["workload"] == "CPU-tiny" and r["tokens_per_s"] > 0
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert len(r["step_times"]) == 2 and len(r["losses"]) == 3
        # The whole curve, warm-up included, as floats.
        assert len(r["loss_curve"]) == 3 and all(isinstance(x, float) for x in r["loss_curve"])
        assert r["loss_curve"][0] == r["first_loss"] and r["loss_curve"][-1] == r["last_loss"]
        assert r["data"]["ids"] == "markov" and r["lr"] == 1e-2  # CPU-tiny's learning rate
        opt = r["options"]["optimizer"]
        assert (opt["name"], opt["lr"], opt["weight_decay"], opt["betas"], opt["eps"]) == (
            "AdamW",
            r["lr"],
            0.0,
            [0.9, 0.999],
            1e-8,
        )
        for key in (
            "date",
            "commit",
            "gpu",
            "versions",
            "options",
            "step_s",
            "peak_gib",
            "reserved_gib",
            "first_loss",
            "last_loss",
            "ceiling_fraction",
            "run_id",
        ):
            assert key in r, key
    assert bench["ours"]["run_id"] == bench["hf_sdpa"]["run_id"]
    assert bench["ours"]["options"]["optimizer"]["source"] == "engine.train.optim.make_optimizer"
    # Same weights, same batches, same targets: the two implementations see the same first loss.
    assert bench["ours"]["first_loss"] == pytest.approx(bench["hf_sdpa"]["first_loss"], rel=1e-4)
    assert bench["ours"]["options"]["fast_paths_report"]  # prepare_model's report is recorded
    assert bench["ours"]["offload_step"] == "double"  # what the last timed step's offload did
    # Three steps cannot show a fall: the speed record has no learning check, so it does not count.
    assert learning_verdict(bench["ours"], recs)["verdict"] == "none"

    # The learning check: 30 steps of ours (all-on) against stock HF + PEFT, same batches.
    learning = [r for r in recs if r["mode"] == "learning"]
    assert len(learning) == 1
    lr = learning[0]
    assert lr["status"].startswith("ok"), lr["status"]
    assert lr["steps"] == 30 and len(lr["loss_curve"]) == 30 and len(lr["ref_loss_curve"]) == 30
    assert lr["variant"] == "all-on" and lr["ref_impl"] == "hf_sdpa" and lr["options"]["offload"] == "double"
    assert lr["stock_fall"] >= 0.3 and lr["max_step_rel_err"] <= 0.02

    parity = [r for r in recs if r["mode"] == "parity"]
    assert len(parity) == 1 and parity[0]["dtype"] == "float32"
    assert parity[0]["status"] == "ok", parity[0]["status"]
    assert parity[0]["grad_rel_err_max"] <= 1e-4 and parity[0]["n_grads"] > 0

    md = tmp_path / "RESULTS.md"
    assert main(["--summarize", "--results", str(results), "--md", str(md)]) == 0
    text = md.read_text()
    assert "CPU-tiny" in text and "| ours |" in text and "Parity" in text
    assert "| ours | ok | no learning check |" in text  # the 3-step speed record does not count
    assert "## Learning check" in text and "| CPU-tiny | all-on | hf_sdpa |" in text
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
    rec = {"mode": "bench", "workload": "W1", "impl": "hf_sdpa", "status": "ok", "gpu": "G", "commit": "c"}
    newer = dict(rec, date="2026-11-29T11:27:00+00:00", tokens_per_s=222_222.0, run_id="new")
    older = dict(rec, date="2026-11-29T11:14:00+00:00", tokens_per_s=111_111.0, run_id="old")
    a.write_text(json.dumps(newer) + "\n" + json.dumps(older) + "\n")
    md = tmp_path / "R.md"
    assert main(["--summarize", "--results", str(a), "--md", str(md)]) == 0
    latest, history = md.read_text().split("<details>")
    assert "222,222" in latest and "111,111" not in latest
    assert "111,111" in history and "| old |" in history  # older records are kept, with their run


STOCK = [11.9, 11.2, 10.6, 10.1, 9.7, 9.4, 9.2, 9.0]  # falls 2.7 nats: first step - mean of the last three


def test_learning_check_rejects_a_flat_curve_and_accepts_a_matching_one():
    flat = [11.9] * len(STOCK)
    bad = learning_check(flat, STOCK)
    assert bad["verdict"] == "FAILED" and bad["ours_fall"] == pytest.approx(0.0, abs=1e-9)
    # Ours is the stock curve up to rounding-sized differences (well inside 2%).
    match = [x * (1 + 0.003 * (-1) ** i) for i, x in enumerate(STOCK)]
    good = learning_check(match, STOCK)
    assert good["verdict"] == "ok", good["reason"]
    assert good["stock_fall"] == pytest.approx(STOCK[0] - sum(STOCK[-3:]) / 3)
    # Over a few steps at a high loss a nearly flat curve stays within 2% of a falling one at
    # every step: the fall is what tells them apart.
    stock = [30.0, 29.8, 29.6, 29.5, 29.4, 29.3]
    nearly_flat = [30.0, 29.95, 29.9, 29.9, 29.85, 29.85]
    c = learning_check(nearly_flat, stock)
    assert c["max_step_rel_err"] <= 0.02 and c["verdict"] == "FAILED" and "fell" in c["reason"]
    # A stock curve that does not fall cannot check anything; nor can curves of other lengths.
    assert learning_check(flat, flat)["verdict"] == "none"
    assert learning_check(match[:-1], STOCK)["verdict"] == "none"
    assert learning_check(None, STOCK)["verdict"] == "none"
    assert learning_check(match[:-1] + [float("nan")], STOCK)["verdict"] == "FAILED"


def _rec(impl, run, tps, curve=None, date="2026-12-01T10:00:00+00:00", **kw):
    r = {
        "mode": "bench",
        "workload": "W1",
        "impl": impl,
        "status": "ok",
        "gpu": "G",
        "commit": "c" + run,
        "run_id": run,
        "date": date,
        "tokens_per_s": tps,
        "options": {"variant": "all-on"} if impl == "ours" else {},
    }
    if curve is not None:
        r["loss_curve"] = curve
    return dict(r, **kw)


def test_summary_never_takes_ratios_or_references_across_runs(tmp_path):
    matching = [x * 1.001 for x in STOCK]
    recs = [
        # Run A: ours learns like stock HF + PEFT of its own run and is 5x faster than it.
        _rec("ours", "A", 50_000.0, matching),
        _rec("hf_sdpa", "A", 10_000.0, STOCK),
        # Run B, later: a faster peer and no ours; a ratio across runs would read 2.00x.
        _rec("hf_flex", "B", 25_000.0, STOCK, date="2026-12-01T11:00:00+00:00"),
        # Run C: ours with a good-looking curve but no stock curve of its own run.
        _rec("ours", "C", 77_777.0, matching, date="2026-12-01T09:00:00+00:00"),
        # Run D: ours that does not learn; run E: a record from before loss curves.
        _rec("ours", "D", 88_888.0, [11.9] * len(STOCK), date="2026-12-01T08:00:00+00:00"),
        _rec("hf_sdpa", "D", 9_000.0, STOCK, date="2026-12-01T08:00:00+00:00"),
        _rec("ours", "E", 99_999.0, date="2026-11-29T08:00:00+00:00"),
    ]
    by = {(r["impl"], r["run_id"]): r for r in recs}
    assert best_peer_same_run(by["ours", "A"], recs) == 10_000.0
    assert best_peer_same_run(by["ours", "C"], recs) is None
    assert learning_verdict(by["ours", "A"], recs)["verdict"] == "ok"
    assert learning_verdict(by["ours", "C"], recs)["verdict"] == "none"  # run A's and B's stock curves are not its own
    assert learning_verdict(by["ours", "D"], recs)["verdict"] == "FAILED"
    assert learning_verdict(by["ours", "E"], recs)["verdict"] == "none"

    results, md = tmp_path / "r.jsonl", tmp_path / "R.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["--summarize", "--results", str(results), "--md", str(md)]) == 0
    text = md.read_text()
    assert "| ours | ok | 50,000 |" in text and "5.00x" in text and "2.00x" not in text
    for speed in ("77,777", "88,888", "99,999"):  # none of them counts as a speed
        assert speed not in text
    assert "FAILED learning" in text and "no learning check" in text
    assert "no stock HF + PEFT / Liger curve in run C" in text


def test_headline_is_one_run_and_repeats_give_median_and_range(tmp_path):
    matching = [x * 1.001 for x in STOCK]
    late = "2026-12-02T10:00:00+00:00"
    recs = [
        # An older run with a faster peer: it must not appear beside the newer run's rows.
        _rec("ours", "old", 40_000.0, matching),
        _rec("hf_flex", "old", 30_000.0, STOCK),
        # The newest run measured each implementation three times (--repeat 3).
        *(dict(_rec("ours", "new", s, matching, date=late), repeat=i) for i, s in enumerate((60e3, 90e3, 70e3), 1)),
        *(dict(_rec("hf_sdpa", "new", s, STOCK, date=late), repeat=i) for i, s in enumerate((10e3, 12e3, 11e3), 1)),
    ]
    results, md = tmp_path / "r.jsonl", tmp_path / "R.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["--summarize", "--results", str(results), "--md", str(md)]) == 0
    headline, history = md.read_text().split("<details>")
    assert "Latest run new" in headline and "3 repeats" in headline
    assert "30,000" not in headline and "| old |" not in headline  # other runs only in the history
    # Median 70,000 over the range 60,000-90,000; the ratio is of the medians within the run.
    assert "| ours | ok | 70,000 | 60,000-90,000 |" in headline and "6.36x" in headline
    assert "3/3 repeats" in headline
    assert "30,000" in history and "90,000" in history  # every record stays in the history


def test_headline_skips_a_later_run_without_a_learning_check(tmp_path):
    """A lever's "before" run measured after the checked one (ours alone, no stock curve) goes to the
    history; the headline stays the newest run whose ours passed its learning check."""
    matching = [x * 1.001 for x in STOCK]
    recs = [
        _rec("ours", "checked", 67_000.0, matching),
        _rec("hf_sdpa", "checked", 14_000.0, STOCK),
        _rec("ours", "before", 65_000.0, matching, date="2026-12-02T10:00:00+00:00"),
    ]
    results, md = tmp_path / "r.jsonl", tmp_path / "R.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["--summarize", "--results", str(results), "--md", str(md)]) == 0
    headline, history = md.read_text().split("<details>")
    assert "Latest run checked" in headline and "| ours | ok | 67,000 |" in headline
    assert "| before |" in history and "no stock HF + PEFT / Liger curve in run before" in history


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
    for x, y in zip(a, b):  # a fresh seed per step, identical in every call
        assert x.lengths == y.lengths and torch.equal(x.ids, y.ids)
    assert a[0].lengths != a[1].lengths and not torch.equal(a[0].ids, a[1].ids)
    for s in a:
        assert sum(s.lengths) == 16_384 and s.num_tokens == 16_384
        assert all(MIN_LEN <= n <= MAX_LEN for n in s.lengths[:-1]) and 1 <= s.lengths[-1] <= MAX_LEN
        assert int(s.ids.max()) < 151_936
    single = make_step(1, 32_768, 128_256, packing="single")
    assert single.lengths == [32_768]


def test_batches_are_learnable():
    # One fixed set of 256 ids for every step; within a document, the next id is the current
    # one's successor in the chain's cycle about 70% of the time (plus 1/256 by chance).
    c = chain(151_936)
    succ = {int(c.symbols[i]): int(c.symbols[c.succ[i]]) for i in range(len(c.symbols))}
    follows = pairs = 0
    for s in make_batches(3, 16_384, 151_936):
        assert set(s.ids.tolist()) <= set(succ)
        for doc in s.documents():
            follows += sum(succ[x] == y for x, y in zip(doc, doc[1:]))
            pairs += len(doc) - 1
    assert 0.65 < follows / pairs < 0.75


def test_batches_are_rebuilt_identically_in_another_process():
    # The Unsloth child rebuilds the batches from the same numbers in its own process.
    code = (
        "import hashlib; from bench.batches import make_batches; "
        "bs = make_batches(3, 4096, 151936); "
        "print(hashlib.sha256(b''.join(b.ids.numpy().tobytes() + bytes(str(b.lengths), 'ascii') "
        "for b in bs)).hexdigest())"
    )
    import hashlib

    here = hashlib.sha256(
        b"".join(b.ids.numpy().tobytes() + bytes(str(b.lengths), "ascii") for b in make_batches(3, 4096, 151_936))
    ).hexdigest()
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONHASHSEED": "123"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


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
    # A failed trial that left memory behind stops the search: later trials would not compare.
    stale, seen = [], []

    def leaky(n):
        seen.append(n)
        stale.append(n)
        return False

    longest, trials = search_longest(leaky, 1, 128, stop=lambda: bool(stale))
    assert longest == 0 and len(trials) == len(seen) == 1


def test_patch_guard_restores_transformers():
    from transformers.models.qwen3 import modeling_qwen3

    from bench.runner import PatchGuard

    rope, forward = modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3MLP.forward
    with PatchGuard("qwen3"):
        modeling_qwen3.apply_rotary_pos_emb = lambda *a, **k: None
        modeling_qwen3.Qwen3MLP.forward = lambda self, x: x
    assert modeling_qwen3.apply_rotary_pos_emb is rope
    assert modeling_qwen3.Qwen3MLP.forward is forward


def test_variants_and_unsupported_switches():
    from bench.ours import fast_path_config, split_fields, variant_fields
    from bench.runner import NotYetSupported

    # every variant is a change from all-on, which offloads with a double buffer
    assert variant_fields("all-on") == {"offload": "double"}
    assert variant_fields("no-fused-ce") == {"offload": "double", "fused_ce": False}
    assert variant_fields("kernels=false+ce_chunk_tokens=4096") == {
        "offload": "double",
        "kernels": False,
        "ce_chunk_tokens": 4096,
    }
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
