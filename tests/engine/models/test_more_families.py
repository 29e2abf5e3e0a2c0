"""Families beyond the ones with fast paths: the engine's loss is the stock model's.

For each decoder-only model_type below (transformers' own classes, a tiny random config), LoRA is
attached the engine's way (`attach_lora`, "all-linear"), the fast paths are switched on as a run
switches them on (`prepare_model` on the CPU: packed attention, the patches where the family has
them, the fused cross-entropy) and the loss of one packed row of three documents is compared with
the stock model's: each document alone through the model's own forward and logits. That catches
logits the stock forward scales (Cohere, Granite, Falcon-H1, MiniCPM3, HyperCLOVA X), layers
patched with the wrong facts, and documents of a packed row that see each other. The memory
estimate reads each config (object and config.json dict) without raising.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import FastPathConfig
from engine.config import LoraConfig as EngineLora
from engine.data.collate import PackedBatch
from engine.models.arch import TINY_BASE, arch_for, logit_scale
from engine.models.estimate import estimate_vram, model_info
from engine.models.lora import all_linear_names, attach_lora
from engine.train.step import forward_loss, prepare_model

LENGTHS = (9, 6, 13)
ROUTED = dict(num_local_experts=4, num_experts_per_tok=2)
# Multi-head latent attention as the real models shape it: queries and keys wider than values and
# not a power of two (DeepSeek-V3: 128 + 64 = 192 against 128; here 16 + 8 = 24 against 16).
MLA = dict(
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4
)
MLA_MOE = dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)

# model_type -> its tiny config beyond TINY_BASE (logit scales set apart from 1, dropout off).
FAMILIES = {
    "granite": dict(logits_scaling=4.0),
    "granitemoe": dict(ROUTED, logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(logit_scale=0.25),
    "hyperclovax": dict(logits_scaling=4.0),
    "minicpm3": dict(MLA, dim_model_base=16),  # logits_scaling = hidden / dim_model_base = 4
    "falcon_h1": dict(
        lm_head_multiplier=0.25,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_chunk_size=16,
        mamba_n_groups=1,
    ),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "ministral": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "ministral3": {},
    "llama4_text": dict(
        num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=2
    ),
    "deepseek_v3": dict(MLA_MOE, n_group=1, topk_group=1, head_dim=8),
    "deepseek_v2": dict(MLA_MOE, n_shared_experts=1, head_dim=8),
    "glm4_moe_lite": dict(MLA_MOE, n_shared_experts=1, head_dim=8),  # GLM-4.7-Flash
    "youtu": dict(MLA, head_dim=8),
    "longcat_flash": dict(
        MLA,
        n_routed_experts=4,
        moe_topk=2,
        expert_ffn_hidden_size=32,
        ffn_hidden_size=64,
        head_dim=8,
        zero_expert_num=0,
    ),
    "mixtral": dict(ROUTED),
    "glm": {},
    "glm4": {},
    "olmo": {},
    "olmo3": {},
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),
    "hunyuan_v1_dense": {},
    "apertus": {},
    "arcee": {},
    "helium": {},
    "stablelm": {},
    "nemotron": {},
    "internlm3": {},
    # Convolution, Mamba and linear-attention layers carry state along a row (Arch.row_state): each
    # document of a packed row runs alone, or it would see the end of the one before it.
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=1,
    ),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "jamba": dict(
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "nemotron_h": dict(
        hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=16
    ),
    "granitemoehybrid": dict(
        ROUTED,
        layer_types=["mamba", "attention"],
        logits_scaling=4.0,
        mamba_d_state=8,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_chunk_size=16,
    ),
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "qwen3_5_moe_text": dict(
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "olmo_hybrid": {},
    "kimi_linear": {},
    "gemma4_text": {},
    "minimax_m2": dict(ROUTED),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "bamba": dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16
    ),
}


def tiny_family(model_type: str, extra: dict, lora: bool = True, without: tuple[str, ...] = ()):
    """(config, LoRA model) of a tiny random `model_type` model with random norms and LoRA B
    (lora=False: the bare transformers model). `without`: TINY_BASE keys the config cannot take."""
    # Token ids inside the tiny vocabulary (several families default to ids of their real one).
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base = {k: v for k, v in TINY_BASE.items() if k not in without}
    cfg = AutoConfig.for_model(model_type, **{**base, **ids, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:  # all-ones (or zeros) would hide a missing scale
                p.add_(torch.randn_like(p) * 0.2)
    if not lora:
        return cfg, model
    model = attach_lora(model, EngineLora(r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return cfg, model.eval()


def stock_loss(model, docs) -> float:
    """Mean next-token loss of the documents, each alone through the model's own forward."""
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([doc])
            logits = model(input_ids=ids, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += len(doc) - 1
    return total / count


def engine_loss(model, docs, fused_ce: bool = True, packed_attention: bool = True) -> float:
    fast = FastPathConfig(fused_ce=fused_ce, packed_attention="auto" if packed_attention else False)
    prepared = prepare_model(model, fast, "cpu", gradient_checkpointing=False)
    batch = PackedBatch.from_documents(docs)
    with torch.no_grad():
        return forward_loss(prepared, batch, batch.num_trained_tokens, fused_ce=fused_ce).item()


def documents(vocab: int = TINY_BASE["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("model_type, extra", FAMILIES.items())
def test_engine_loss_is_the_stock_loss(model_type, extra):
    cfg, model = tiny_family(model_type, extra)
    docs = documents()
    ref = stock_loss(model, docs)
    got = engine_loss(model, docs)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    for source in (cfg, cfg.to_dict()):  # the estimate reads the config and a folder's config.json
        info = model_info(source)
        assert info.num_params > 0
        for mode in ("lora16", "qlora4"):
            assert estimate_vram(info, 512, lora_r=8, mode=mode) > 0


def test_logit_scales_are_the_stock_forwards():
    # The scale each file names is the one the stock forward applies, and it is not 1 in these configs.
    expected = {"granite": 0.25, "granitemoe": 0.25, "cohere": 0.25, "hyperclovax": 4.0, "minicpm3": 0.25}
    for model_type, scale in expected.items():
        cfg = AutoConfig.for_model(model_type, **{**TINY_BASE, **FAMILIES[model_type]})
        assert arch_for(model_type).logit_scale(cfg) == pytest.approx(scale) == logit_scale(cfg)
    assert logit_scale(AutoConfig.for_model("llama")) == 1.0


def test_unfused_loss_scales_the_logits_too():
    _, model = tiny_family("cohere", FAMILIES["cohere"])
    docs = documents()
    assert engine_loss(model, docs, fused_ce=False) == pytest.approx(stock_loss(model, docs), rel=1e-5)


def test_all_linear_leaves_out_what_peft_cannot_wrap():
    from torch import nn

    # Llama-4's router is a Linear subclass returning a tuple; a Mamba mixer's out_proj PEFT refuses.
    _, llama4 = tiny_family("llama4_text", FAMILIES["llama4_text"], lora=False)
    assert any(name.endswith("router") and isinstance(m, nn.Linear) for name, m in llama4.named_modules())
    names = set(all_linear_names(llama4))
    assert "router" not in names and {"q_proj", "o_proj", "gate_proj"} <= names
    _, falcon_h1 = tiny_family("falcon_h1", FAMILIES["falcon_h1"], lora=False)
    assert any(name.endswith("mamba.out_proj") for name, _ in falcon_h1.named_modules())
    names = set(all_linear_names(falcon_h1))
    assert "out_proj" not in names and {"in_proj", "o_proj"} <= names


def test_a_row_state_family_runs_each_document_alone_and_says_so():
    from engine.counters import Counters, split_counts
    from engine.train.step import install_offload

    _, model = tiny_family("lfm2", FAMILIES["lfm2"])
    docs = documents()
    counters = Counters()
    with counters.active():
        engine_loss(model, docs)
    _, fallbacks = split_counts(counters)
    assert any("packed_rows" in key and "each document runs alone" in key for key in fallbacks), fallbacks
    # The offloader keeps one input per layer and step; several forwards per step would overwrite it.
    offloader, line = install_offload(model, "single", "cpu")
    assert offloader is None and "each document alone" in line
    # A family without the fact packs as before: nothing counted.
    _, llama = tiny_family("ministral3", FAMILIES["ministral3"])
    counters = Counters()
    with counters.active():
        engine_loss(llama, docs)
    assert not any("packed_rows" in key for key in split_counts(counters)[1])


def test_all_linear_names_no_other_module():
    # Zamba-2 keeps Linear layers in lists ("...adapter_list.0.0"): "0" alone would name decoder layers.
    from torch import nn

    zamba2 = dict(
        mamba_d_state=8,
        mamba_headdim=8,
        n_mamba_heads=4,
        mamba_ngroups=1,
        chunk_size=16,
        layers_block_type=["mamba", "hybrid"],
        num_mem_blocks=1,
    )
    _, model = tiny_family("zamba2", zamba2, lora=False)
    names = all_linear_names(model)
    assert "0" not in names and "q_proj" in names
    linears = {path for path, m in model.named_modules() if type(m) is nn.Linear and m is not model.lm_head}
    lora = attach_lora(model, EngineLora(r=4, alpha=8))
    wrapped = {path.removeprefix("base_model.model.") for path, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == linears


def test_describe_says_what_keeps_the_stock_forward():
    from engine.models.patches import describe_fast_paths

    arcee = describe_fast_paths("arcee")
    assert arcee["lora_qkv"] == "on" and arcee["rmsnorm"] == "on"
    assert "MLP is not gated" in arcee["lora_mlp"] and "MLP is not gated" in arcee["activations"]
    olmo3 = describe_fast_paths("olmo3")  # norms after attention and the MLP: no add to fuse before one
    assert olmo3["lora_mlp"] == olmo3["rope"] == "on" and "not one it reproduces" in olmo3["add_rmsnorm"]


def test_a_family_whose_code_ships_with_the_model_names_the_config_field(tmp_path):
    # InternLM2's folders carry their modeling code (auto_map); transformers has no class of its own.
    import json
    import shutil

    from engine.config import ModelConfig
    from engine.models.loading import ModelLoadError, load_model
    from engine.resources import DEMO_MODEL_DIR

    folder = tmp_path / "internlm2"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="internlm2",
        architectures=["InternLM2ForCausalLM"],
        auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.trust_remote_code: true"):
        load_model(ModelConfig(name_or_path=str(folder)), "cpu", "float32")


def test_all_linear_takes_gpt2s_conv1d_and_falcons_linear():
    # GPT-2's projections are transformers' Conv1D and Falcon's a Linear subclass: before, "all-linear"
    # found nothing in either, and PEFT refused the run ("No `target_modules` passed").
    from engine.models.lora import peft_lora_config

    _, gpt2 = tiny_family("gpt2", {}, lora=False)
    assert set(all_linear_names(gpt2)) == {"c_attn", "c_proj", "c_fc"}
    assert peft_lora_config(EngineLora(r=4, alpha=8), gpt2).fan_in_fan_out  # said in adapter_config.json
    _, falcon = tiny_family("falcon", {}, lora=False, without=("head_dim",))
    assert {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"} <= set(all_linear_names(falcon))
    assert not peft_lora_config(EngineLora(r=4, alpha=8), falcon).fan_in_fan_out
