"""The benches that run `tunesmith train` as a user does: bench.laptop's case grammar (a cap, a
model shape, QLoRA or not, the case's own settings) turned into the studio preset a user would
run; bench.ddp end to end on gloo; and their own RESULTS.md rows."""

from __future__ import annotations

import pytest

from bench.laptop import card_for, parse_case, run_config
from engine.config import RunConfig


def test_a_case_names_its_cap_card_model_and_overrides():
    assert parse_case("8:qwen3-4b-qlora") == (8, "qwen3-4b", True, {})
    assert parse_case("7.5:qwen3-8b-qlora+seq=8192+rows=1") == (7.5, "qwen3-8b", True, {"seq": 8192, "rows": 1})
    # A cap between two cards' sizes is the larger card with a desktop using the rest.
    assert card_for(7.5) == card_for(8) == "NVIDIA GeForce RTX 4060 Laptop GPU"
    for bad in ("8:qwen3-9b", "32:qwen3-4b", "8:qwen3-4b+depth=3", "x:qwen3-4b"):
        with pytest.raises(SystemExit):
            parse_case(bad)


def test_the_case_config_is_the_preset_with_the_case_settings(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    _, _, qlora, overrides = parse_case("16:qwen3-4b-qlora+seq=2048+rows=1+accum=8")
    cfg = RunConfig.load(run_config(tmp_path / "model", data, qlora, 20, tmp_path / "runs" / "a", overrides))
    assert cfg.model.load_in_4bit is True  # the laptop-qlora preset
    assert (cfg.data.max_seq_len, cfg.training.rows_per_micro_batch, cfg.training.grad_accum) == (2048, 1, 8)
    assert cfg.training.max_steps == 20 and cfg.training.save_every == 0

    plain = RunConfig.load(run_config(tmp_path / "model", data, False, 20, tmp_path / "runs" / "b", accum=1))
    assert plain.model.load_in_4bit == "auto"  # the quality preset: 4-bit only where 16-bit does not fit
    assert plain.training.rows_per_micro_batch == "auto" and plain.training.grad_accum == 1

    _, _, _, hosted = parse_case("16:qwen3-4b-qlora+seq=2048+host=1")
    assert hosted == {"seq": 2048, "host": 1}
    cfg = RunConfig.load(run_config(tmp_path / "model", data, True, 20, tmp_path / "runs" / "c", hosted))
    assert cfg.fast_paths.host_embeddings is True
    _, _, _, full = parse_case("7.5:qwen3-8b-qlora+seq=8192+rows=1+lean=0")
    cfg = RunConfig.load(run_config(tmp_path / "model", data, True, 20, tmp_path / "runs" / "d", full))
    assert cfg.fast_paths.lean_recompute is False


def test_results_md_has_the_multi_gpu_and_laptop_rows(tmp_path):
    """The records of bench.fsdp / bench.ddp / bench.laptop become their own RESULTS.md rows,
    and a measurement that is missing says why."""
    import json

    from bench.report import laptop_section, multi_gpu_section

    multi = tmp_path / "multi_gpu.jsonl"
    fsdp = {"bench": "fsdp", "model": "Llama-3.1-70B shape", "world_size": 2, "shape": {"layers": 80}}
    fsdp.update(base_params=70.5e9, tokens_per_s_median=2415.5, peak_mem_gib_per_gpu=[81.5, 81.5], losses=[13.4, 7.5])
    ddp = {"bench": "ddp", "model": "qwen3-8b", "gpus": 2, "tokens_per_s_2": 20000, "speedup": 1.9, "peak_gib_2": 19}
    ddp.update(loss_2=[12.0, 9.0])
    missing = {"bench": "ddp-missing", "model": "qwen3-8b", "gpus": 2, "missing": "the call ran out of time"}
    multi.write_text("".join(json.dumps(r) + "\n" for r in (fsdp, ddp, missing)))
    text = "\n".join(multi_gpu_section(multi))
    assert "| fsdp | Llama-3.1-70B shape (80 layers, 70.5B bf16, LoRA r=16) | 2 | 2,416 |" in text
    assert "| ddp | qwen3-8b | 2 | 20,000 | 1.90x | 19.00 | 12.000 -> 9.000 |" in text
    assert "| missing |" in text and "the call ran out of time" in text

    laptop = tmp_path / "laptop.jsonl"
    rec = {"case": "8:qwen3-4b-qlora", "cap_gib": 8, "card": "NVIDIA GeForce RTX 4060 Laptop GPU", "model": "qwen3-4b"}
    rec.update(qlora=True, rc=0, steps=20, steps_asked=20, peak_gib=6.0, cap_used=0.75, tokens_per_s=5000)
    rec.update(loss_first=12.4, loss_last=5.6, outcome="Finished", commit="abc1234", parallel=1)
    rec.update(chosen={"load_in_4bit": True, "rows_per_micro_batch": 14, "grad_accum": 2, "max_seq_len": 1024})
    rec.update(preflight={"rows_per_micro_batch": 17})
    older = dict(rec, peak_gib=5.0, cap_used=0.625, commit="0ld0000", preflight={})
    laptop.write_text(json.dumps(older) + "\n" + json.dumps(rec) + "\n")
    section = laptop_section(laptop)
    latest = section[section.index("### Each case's latest record") + 2].splitlines()
    assert len(latest) == 3  # the header, its rule and the newer record alone
    row = latest[2]
    assert row.startswith("| 8 GiB (RTX 4060 Laptop GPU) | qwen3-4b QLoRA | 4-bit, 14 row(s) of 1024 x 2 accum")
    assert "pre-flight: 17 rows per forward" in row and "| 20 | 6.0 GiB | 75% | - GiB | 5,000 |" in row
    history = section[section.index("### Every record, oldest first") + 2].splitlines()
    assert [r.split("|")[-2].strip() for r in history[2:]] == ["0ld0000", "abc1234"]


@pytest.mark.slow  # one process, then two under torchrun, on the same steps (33 s on an idle machine here)
def test_bench_ddp_compares_one_process_with_two_on_the_same_steps(tmp_path):
    """bench.ddp end to end on the CPU (gloo): `tunesmith train` once and with `--gpus 2` on the
    demo model; the record holds both curves (equal: the same global batch), both speeds and
    their ratio."""
    import json
    import subprocess
    import sys

    from child_process import ROOT, child_env

    out = tmp_path / "ddp.jsonl"
    args = ["--folder", str(ROOT / "resources" / "demo_model"), "--gpus", "2", "--steps", "4", "--rows", "1"]
    args += ["--seq-len", "128", "--work", str(tmp_path), "--out", str(out), "--run-seconds", "400"]
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "bench.ddp", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["bench"] == "ddp" and rec["rc_1"] == 0 and rec["rc_2"] == 0
    assert len(rec["loss_1"]) == len(rec["loss_2"]) == 4
    assert rec["max_step_rel_diff"] < 1e-3, (rec["loss_1"], rec["loss_2"])
    assert rec["speedup"] > 0 and rec["tokens_per_s_1"] > 0
