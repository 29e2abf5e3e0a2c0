"""`training.distributed: auto` and the families whose layers carry state along a row (LFM2, Jamba,
Nemotron-H, Qwen3.5, ...): FSDP cannot train them (engine.train.fsdp.alone_refusal), so the
policy keeps them on DDP while one row fits one GPU, and where it does not, the run's setup
refuses it before anything loads with a message that says the base does not fit.

The models are transformers config classes at real sizes (no weights); the machine is an
injected profile of two H200s (a 137 GiB budget each)."""

from __future__ import annotations

import json

import pytest
import transformers

from engine.config import ConfigError, RunConfig
from engine.hardware import policy
from engine.hardware.profile import GiB, GpuProperties, MiB, profile_from_properties
from engine.models.estimate import model_info
from engine.resources import DEMO_PRESET
from engine.train.distributed import DistContext

# Sizes of a ~62B and a ~82B dense model: 16-bit bases of ~115 and ~153 GiB.
SIZES = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8)
CROWDS, OVER = 72, 96  # layers


def two_h200s():
    gpu = GpuProperties("NVIDIA H200", 143771 * MiB, (9, 0), free_memory=143000 * MiB)
    return profile_from_properties(gpu, gpu_count=2, ram_total=512 * GiB)


def lfm2(layers):
    return transformers.Lfm2Config(**SIZES, num_hidden_layers=layers, vocab_size=65536)


def llama(layers):
    return transformers.LlamaConfig(**SIZES, num_hidden_layers=layers, vocab_size=65536)


def resolve(hf_config, load_in_4bit="auto"):
    cfg = RunConfig()
    cfg.model.name_or_path = "big-model"  # the shapes come from model_info below
    cfg.model.load_in_4bit = load_in_4bit
    cfg.data.max_seq_len = 4096
    return policy.resolve_defaults(cfg, two_h200s(), model_info(hf_config), world_size=2)


def test_a_plain_llama_over_the_share_of_one_gpu_is_sharded():
    out = resolve(llama(CROWDS))
    assert out.config.model.load_in_4bit is False  # one row fits in 16 bits: no 4-bit
    value, reason = out.choices["training.distributed"]
    assert value == "fsdp" and "FSDP2 shards it" in reason


def test_a_row_state_model_of_the_same_size_stays_on_ddp_and_says_why():
    out = resolve(lfm2(CROWDS))
    assert out.config.model.load_in_4bit is False
    value, reason = out.choices["training.distributed"]
    assert value == "ddp"
    assert "lfm2: its layers carry state along a row" in reason and "FSDP cannot train it" in reason
    assert "4096-token row fits" in reason
    # The rest of the plan is sized for the whole base on each device, not a shard.
    assert "memory.sharded" not in out.notes
    assert out.verdict == "fits"


@pytest.mark.parametrize(
    "family",
    [
        lambda: transformers.JambaConfig(
            **SIZES, num_hidden_layers=CROWDS, vocab_size=65536, num_experts=1, num_experts_per_tok=1
        ),
        lambda: transformers.Qwen3NextConfig(**SIZES, num_hidden_layers=60, vocab_size=65536, num_experts=0),
    ],
    ids=["jamba", "qwen3_next"],
)
def test_other_row_state_families_stay_on_ddp(family):
    hf = family()
    info = model_info(hf)
    budget = policy.budget_for("cuda", two_h200s())
    assert info.num_params * 2 > policy.FSDP_WEIGHTS_SHARE * budget.memory, info.summary()  # premise: over the share
    value, reason = resolve(hf).choices["training.distributed"]
    assert value == "ddp" and f"{info.model_type}: its layers carry state along a row" in reason


def test_a_small_row_state_model_is_ddp_as_any_small_model():
    value, reason = resolve(lfm2(8)).choices["training.distributed"]
    assert value == "ddp" and "fits one device" in reason


def test_a_row_state_base_that_fits_no_gpu_goes_4_bit_on_auto():
    out = resolve(lfm2(OVER))
    assert out.config.model.load_in_4bit is True
    assert out.choices["training.distributed"][0] == "ddp"


def test_a_row_state_base_that_fits_no_gpu_in_16_bits_says_so():
    value, reason = resolve(lfm2(OVER), load_in_4bit=False).choices["training.distributed"]
    assert value == "fsdp"  # only sharding would fit it, and the setup refuses that (below)
    assert "does not fit one device's" in reason and "FSDP, which would shard it, cannot train lfm2" in reason
    assert "model.load_in_4bit: true" in reason


def test_the_setup_refuses_it_before_anything_starts_saying_it_does_not_fit(tmp_path, monkeypatch):
    import torch

    from engine.hardware import profile
    from engine.train.run_setup import configure

    folder = tmp_path / "lfm2-82b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(lfm2(OVER).to_dict()))
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.name_or_path = str(folder)
    cfg.model.load_in_4bit = False
    cfg.data.max_seq_len = 4096
    cfg.output.dir = str(tmp_path / "runs")
    cfg.training.grad_accum = 2  # a plan two processes can share
    monkeypatch.setattr(profile, "detect", two_h200s)  # the machine the run would meet
    with pytest.raises(ConfigError) as err:
        configure(cfg, DistContext(rank=0, world_size=2, local_rank=0), None, None, None)
    text = str(err.value)
    assert err.value.path == "training.distributed"
    assert "auto chose fsdp" in text and "does not fit one device's" in text and "cannot train lfm2" in text
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "runs").exists()


def test_a_row_state_model_is_planned_without_offload_which_does_not_run_for_it():
    # engine.train.step installs no offloader for these families (one forward per document), so
    # the plan must not count on it: the micro-batch is sized with every layer input on the card.
    out = resolve(lfm2(CROWDS))
    value, reason = out.choices["training.offload"]
    assert value == "off" and "lfm2 runs each document of a row as its own forward" in reason
    assert "(offload off)" in out.choices["training.rows_per_micro_batch"][1]
