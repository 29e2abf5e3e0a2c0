"""The CPU learning-parity tier: the fast paths learn like the stock HF + PEFT path over 30
optimizer steps of the real TrainingSession, in fp32 (every step's loss within 1e-4 relative,
the adapters within 1e-3 norm-relative).

The first case is the regression test for the stale adapter cache: with AdamW(fused=True)
(the engine's optimizer on CUDA, and available on the CPU) the fused LoRA Functions kept
serving the step-0 adapters, because the fused optimizer does not bump `_version`; the loss
curve then departs from the stock one at step 2. On the CPU the hardware policy turns the fast
paths off, so each case asks for them explicitly. The GPU tier (tests/gpu/test_learning_gpu.py)
covers every combination in bf16 at real shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from learning_parity import compare, curve_table, learnable_jsonl, make_config, stock, train  # noqa: E402

# Every fast path on (the CPU runs their torch references; the Triton kernels have their own
# interpreter tests at small shapes).
ALL_ON = dict(kernels=True, lora_autograd=True, fused_ce=True, packed_attention=True, cached_metadata=True)
FP32 = dict(step_rel=1e-4, final_rel=1e-4, min_fall=0.5, fall_rel=0.01, adapter_rel=1e-3)
STEPS, SEQ = 30, 192

_REFS: dict = {}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return learnable_jsonl(tmp_path_factory.mktemp("learnable"), docs=300)


def _cfg(tmp_path, data, **training):
    return make_config("demo", data, tmp_path / "ours", steps=STEPS, seq=SEQ, fast=ALL_ON, **training)


def _reference(cfg, tmp_path_factory):
    ref = stock(cfg)
    key = (ref.training.grad_accum, ref.training.rows_per_micro_batch)
    if key not in _REFS:
        _REFS[key] = train(ref, tmp_path_factory.mktemp("stock"))
    return _REFS[key]


def _assert_learns_like(ours, ref):
    problems = compare(ours, ref, **FP32)
    assert not problems, "\n".join(problems) + "\n" + curve_table({"stock": ref, "ours": ours})


def _assert_fused_ran(curve):
    assert curve.fast_report["lora_mlp"].startswith("on") and curve.fast_report["lora_qkv"].startswith("on"), (
        curve.fast_report
    )
    for s in curve.steps:
        # Counted per step: the fused Functions and the kernels' references ran, nothing fell back.
        calls = s.fast_path_calls
        for key in ("lora_mlp", "lora_linears", "rmsnorm:torch", "fused_ce:torch", "attention:reference"):
            assert calls.get(key, 0) > 0, (key, calls)
        assert not s.fallbacks, s.fallbacks


@pytest.mark.slow
def test_fused_lora_with_fused_adamw_learns_like_stock(tmp_path, tmp_path_factory, data):
    cfg = _cfg(tmp_path, data, optimizer="adamw_fused")
    ours = train(cfg)
    _assert_fused_ran(ours)
    _assert_learns_like(ours, _reference(cfg, tmp_path_factory))


@pytest.mark.slow
def test_fused_lora_with_stock_adamw_and_double_offload_learns_like_stock(tmp_path, tmp_path_factory, data):
    cfg = _cfg(tmp_path, data, optimizer="adamw", offload="double", gradient_checkpointing=True)
    ours = train(cfg)
    _assert_fused_ran(ours)
    assert "double" in ours.steps[-1].offload
    _assert_learns_like(ours, _reference(cfg, tmp_path_factory))


@pytest.mark.slow
def test_gradient_accumulation_learns_like_stock(tmp_path, tmp_path_factory, data):
    cfg = _cfg(tmp_path, data, optimizer="adamw_fused", grad_accum=2)
    cfg.data.max_seq_len = SEQ // 2
    ours = train(cfg)
    _assert_fused_ran(ours)
    _assert_learns_like(ours, _reference(cfg, tmp_path_factory))


@pytest.mark.slow
def test_stop_and_resume_learns_like_an_uninterrupted_stock_run(tmp_path, tmp_path_factory, data):
    """A resumed run loads adapter weights in place: the cache must see that too."""
    cfg = _cfg(tmp_path, data, optimizer="adamw_fused")
    first = train(cfg, stop_after=11)
    assert len(first.losses) == 11
    second = train(cfg, resume_from=first.run_dir)
    ours = type(first)(first.losses + second.losses, second.adapter, first.steps + second.steps)
    _assert_learns_like(ours, _reference(cfg, tmp_path_factory))
