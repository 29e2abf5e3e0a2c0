"""The memory estimate and fast_paths.lean_recompute (engine.fastpath.recompute): under offload the
recompute keeps neither gate nor up for the backward, which remakes them a row tile at a time.
The estimate takes that off where the lean recompute will run, conservatively: on Qwen3-8B at
16,384 tokens (W3) it falls less than the measured peak did (18.41 -> 17.53 GiB, bench/results
2026-12-02) and stays above that measured peak."""

from __future__ import annotations

import pytest
import transformers

from engine.config import RunConfig
from engine.hardware import policy
from engine.hardware.profile import GiB, GpuProperties, MiB, profile_from_properties
from engine.models import estimate as est

TOKENS = 16_384
MEASURED_FULL, MEASURED_LEAN = 18.41 * GiB, 17.53 * GiB  # W3 peaks, lean_recompute false / true


def qwen3_8b():
    return est.model_info(
        transformers.Qwen3Config(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151_936,
            tie_word_embeddings=False,
        )
    )


def llama_1b():  # Llama-3.2-1B's shapes (W2)
    return est.model_info(
        transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128_256,
            tie_word_embeddings=True,
        )
    )


def _estimate(info, lean, mode="lora16", offload="double", ckpt=True):
    return est.estimate_vram(
        info, TOKENS, 16, mode, TOKENS, ckpt, offload=offload, ce_chunk_tokens=4096, lean_recompute=lean
    )


def test_the_lean_recompute_lowers_the_w3_estimate_by_less_than_the_measured_fall():
    info = qwen3_8b()
    full, lean = _estimate(info, False), _estimate(info, True)
    assert est.lean_recompute_saving(info, TOKENS) == (768 - 240) * MiB  # gate + up kept, less 5 live tiles
    assert full - lean >= 512 * MiB
    assert full - lean <= MEASURED_FULL - MEASURED_LEAN  # conservative: never more than the peak fell
    assert lean > MEASURED_LEAN  # and still above what the step measured
    working = est.estimate_breakdown(info, TOKENS, offload="double", lean_recompute=True).working
    assert working == est.estimate_breakdown(info, TOKENS, offload="double").working - (768 - 240) * MiB


@pytest.mark.parametrize(
    "case",
    [
        dict(offload="off"),  # no offload, no recompute of that kind
        dict(ckpt=False),
    ],
)
def test_no_saving_where_the_lean_recompute_does_not_run(case):
    info = qwen3_8b()
    assert _estimate(info, True, **case) == _estimate(info, False, **case)


def test_a_4bit_base_saves_less_by_its_three_dense_mlp_weights():
    # The backward's tiles read gate, up and down dequantized once (dense_4bit_once): 3 x 96 MiB on Qwen3-8B.
    info = qwen3_8b()
    dense = 3 * 4096 * 12288 * 2
    assert est.lean_recompute_saving(info, TOKENS, "qlora4") == (768 - 240) * MiB - dense
    full = est.estimate_breakdown(info, TOKENS, mode="qlora4", offload="double").working
    lean = est.estimate_breakdown(info, TOKENS, mode="qlora4", offload="double", lean_recompute=True).working
    assert full - lean == (768 - 240) * MiB - dense
    assert est.lean_recompute_saving(info, 4096, "qlora4") == 0  # short rows: the copies outweigh it


def test_a_short_micro_batch_saves_nothing_the_tiles_would_not_take_back():
    # Up to 2.5 tiles of rows the live tiles weigh as much as the whole gate and up.
    info = qwen3_8b()
    assert est.lean_recompute_saving(info, 4096) == 0
    assert est.lean_recompute_saving(info, 8192) == 2 * 8192 * 12288 * 2 - 5 * 2048 * 12288 * 2


def test_the_estimate_tiles_as_the_backward_does():
    import torch

    from engine.fastpath import lora
    from engine.hardware.fast_path_choices import LEAN_RECOMPUTE_MIN_HIDDEN as POLICY_MIN_HIDDEN
    from engine.train.step import LEAN_RECOMPUTE_MIN_HIDDEN

    assert est.LEAN_TILE_BYTES == lora.UNREAD_TILE_BYTES
    assert lora._tile_rows(12288, torch.bfloat16.itemsize) == 2048
    assert POLICY_MIN_HIDDEN == LEAN_RECOMPUTE_MIN_HIDDEN  # the policy's "auto" is the step's


def h200():
    gpu = GpuProperties("NVIDIA H200", 143771 * MiB, (9, 0), free_memory=143000 * MiB)
    return profile_from_properties(gpu, ram_total=256 * GiB)


def _resolved(info, **fast):
    cfg = RunConfig()
    cfg.model.name_or_path = "qwen3"
    cfg.data.max_seq_len = TOKENS
    cfg.training.rows_per_micro_batch = 1
    cfg.training.gradient_checkpointing = True
    cfg.training.offload = "double"
    cfg.lora.dropout = fast.pop("dropout", 0.0)
    for name, value in fast.items():
        setattr(cfg.fast_paths, name, value)
    return policy.resolve_defaults(cfg, h200(), info)


def test_the_policy_counts_it_where_the_step_will_take_it():
    info = qwen3_8b()
    auto = _resolved(info)
    off = _resolved(info, lean_recompute=False)
    assert off.estimate - auto.estimate >= 512 * MiB  # auto: on from hidden 4,096
    # Anything that keeps the step off the lean path keeps the full recompute in the estimate.
    assert _resolved(info, dropout=0.05).estimate == off.estimate  # no fused LoRA MLP
    assert _resolved(info, lora_autograd=False).estimate == off.estimate
    assert _resolved(info, kernels=False).estimate == off.estimate  # no patched decoder layer
    # Hidden 2,048: auto leaves it off (launch-bound); set true, the estimate counts it, by less
    # than W2's measured peak fell (3.78 -> 3.34 GiB).
    small = llama_1b()
    assert _resolved(small).estimate == _resolved(small, lean_recompute=False).estimate
    fall = _resolved(small).estimate - _resolved(small, lean_recompute=True).estimate
    assert 0 < fall < (3.78 - 3.34) * GiB


def test_the_micro_batch_may_grow_by_what_the_lean_recompute_frees():
    # A budget that one full-recompute row does not fit but a lean one does: 16-bit stays.
    info = qwen3_8b()
    plain = policy.Sizer(info, TOKENS, 16, 4096)
    lean = policy.Sizer(info, TOKENS, 16, 4096, lean_recompute=True)
    assert lean("lora16", TOKENS, True, "double") < plain("lora16", TOKENS, True, "double")
    assert lean("lora16", TOKENS, True, "off") == plain("lora16", TOKENS, True, "off")
