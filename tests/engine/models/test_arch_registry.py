"""engine.models.arch: each architecture's file against the transformers model it describes.

A tiny random model of every architecture with a tiny config (tests/tiny_models.py) is built and
its file's facts are checked against it: the parameter count the estimate reads from the config
alone (norms, q/k norms, biases, sinks, experts) equals the model's; the class names it gives
are the model's own; the extra norms, q/k norms and MoE block it names are there; the patches
patch every module of the classes it names and nothing else.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import FastPathConfig
from engine.fastpath import patching
from engine.models.arch import ARCHS, GENERIC, arch_for, patched, tiny_archs
from engine.models.estimate import model_info
from engine.models.patches import REGISTRY, apply_fast_paths, describe_fast_paths
from tests.tiny_models import tiny_config, tiny_model

TINY = tiny_archs()
ON = FastPathConfig(kernels=True, lora_autograd=True)


def test_every_model_type_is_one_transformers_knows():
    from transformers import CONFIG_MAPPING

    unknown = sorted(name for name in ARCHS if name not in CONFIG_MAPPING)
    assert unknown == []
    assert arch_for("no_such_family") is None and arch_for(None) is None
    assert REGISTRY == patched() and all(arch.hf_classes is not None for arch in REGISTRY.values())


@pytest.mark.parametrize("model_type", TINY)
def test_estimate_counts_the_tiny_models_parameters(model_type):
    cfg = tiny_config(model_type)
    model = tiny_model(model_type, attn="eager")
    actual = sum(p.numel() for p in model.parameters())
    assert model_info(cfg).num_params == actual
    assert model_info(cfg.to_dict()).num_params == actual  # as from a folder's config.json


@pytest.mark.parametrize("model_type", TINY)
def test_the_file_names_the_models_own_modules(model_type):
    arch = arch_for(model_type)
    model = tiny_model(model_type, attn="eager")
    names = {type(m).__name__ for m in model.modules()}
    c = arch.hf_classes
    assert type(model).__name__ == c.causal_lm and type(model.model).__name__ == c.model
    assert {c.norm, c.attention, c.decoder_layer} <= names
    layers = model.model.layers
    assert all(type(layer).__name__ == c.decoder_layer for layer in layers)
    for layer in layers:
        for norm in arch.extra_norms:
            assert type(getattr(layer, norm)).__name__ == c.norm
        attn = layer.self_attn
        assert type(attn).__name__ == c.attention
        assert hasattr(attn, "q_norm") == arch.qk_norm and hasattr(attn, "sinks") == arch.attention_sinks
    if arch.moe is None:
        assert c.mlp in names
    else:
        blocks = [m for m in model.modules() if type(m).__name__ == arch.moe.block]
        assert len(blocks) == len(layers)
        for block in blocks:
            experts = getattr(block, arch.moe.experts)
            assert hasattr(block, arch.moe.router)
            assert all(isinstance(getattr(experts, w), torch.Tensor) for w in arch.moe.expert_weights)


# Each patched file once, by its own model_type (an alias, Gemma-3's multimodal "gemma3", is the
# same modules; test_patches checks that wrapper).
@pytest.mark.parametrize("model_type", sorted(n for n, arch in REGISTRY.items() if n == arch.model_type))
def test_patches_cover_exactly_the_classes_the_file_names(model_type):
    arch = arch_for(model_type)
    model = tiny_model(model_type, attn="eager", lora={})
    report = apply_fast_paths(model, ON, "cpu")
    assert report["rmsnorm"] == "on" and report["rope"] == "on" and report["lora_qkv"] == "on", report
    assert (report["add_rmsnorm"] == "on") == arch.fused_add_norm, report
    c = arch.hf_classes
    for module in model.modules():
        name, patch = type(module).__name__, patching.installed(module, "patches")
        if name in (c.norm, c.attention) or (name == c.mlp and report["lora_mlp"] == "on"):
            assert patch is not None, name
        elif name == c.decoder_layer:  # its patch fuses the add after attention with the norm after it
            assert (patch is not None) == arch.fused_add_norm, name
        else:
            assert patch is None, name
    norms = [m for m in model.modules() if type(m).__name__ == c.norm]
    layers = model.config.num_hidden_layers
    # Per layer its norms (and q/k norms), then the final norm.
    assert len(norms) == layers * (arch.norms_per_layer + 2 * arch.qk_norm) + 1


def test_attention_kwargs_follow_the_window_and_softcap_facts():
    from transformers.models.mistral.modeling_mistral import MistralAttention

    mistral = tiny_model("mistral", attn="eager")
    attn = next(m for m in mistral.modules() if isinstance(m, MistralAttention))
    assert arch_for("mistral").attn_kwargs(attn) == {"sliding_window": 8}  # from the config
    gemma2 = tiny_model("gemma2", attn="eager")
    first, second = (layer.self_attn for layer in gemma2.model.layers)
    assert arch_for("gemma2").attn_kwargs(first) == {"sliding_window": 8, "softcap": 20.0}
    assert arch_for("gemma2").attn_kwargs(second) == {"sliding_window": None, "softcap": 20.0}
    assert arch_for("llama").attn_kwargs(attn) == {}


def test_describe_reads_the_moe_fact():
    assert describe_fast_paths("gpt_oss")["moe_grouping"] == "on"
    assert describe_fast_paths("qwen3_moe")["moe_grouping"] == "on" and describe_fast_paths("qwen3_moe")["rope"] == "on"
    assert "moe_grouping" not in describe_fast_paths("qwen2_moe")  # named, not grouped
    assert "has no patch" in describe_fast_paths("phi3")["rmsnorm"]


def test_unknown_families_count_as_the_generic_decoder():
    cfg = tiny_config("llama").to_dict()
    assert model_info({**cfg, "model_type": "some_new_family"}).num_params == model_info(cfg).num_params
    assert GENERIC.gated_mlp and GENERIC.norms_per_layer == 2 and not GENERIC.qkv_bias


def test_tiny_config_layers_base_arch_and_overrides():
    cfg = tiny_config("qwen2", hidden_size=32, sliding_window=4)
    assert (cfg.hidden_size, cfg.sliding_window, cfg.attention_bias, cfg.num_key_value_heads) == (32, 4, True, 2)
    with pytest.raises(ValueError, match="qwen2_vl"):
        tiny_config("qwen2_vl")
