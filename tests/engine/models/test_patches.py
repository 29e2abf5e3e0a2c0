"""The per-architecture patch registry (engine.models.patches) on tiny random models.

For each supported model_type: the patched model gives the same loss and the same LoRA
gradients as the stock HF + PEFT model on one packed row (positions restarting per document),
in fp32 to 1e-4 relative. Also: attention kwargs reach the attention function unchanged,
gradient checkpointing, bf16, the Triton path through the interpreter, fallbacks with reasons,
and the per-call stock fallbacks (disabled adapters, KV cache).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import FastPathConfig
from engine.counters import reset_counters
from engine.fastpath import patching
from engine.fastpath.attention import disable_packed_attention, enable_packed_attention
from engine.models.arch import arch_for
from engine.models.patches import FAST_PATHS, apply_fast_paths, remove_fast_paths
from tests.tiny_models import tiny_model

CPU = torch.device("cpu")
ARCHS = [
    "llama",
    "mistral",
    "ministral",
    "smollm3",
    "arcee",
    "qwen2",
    "qwen3",
    "olmo2",
    "olmo3",
    "exaone4",
    "gemma",
    "gemma2",
    "gemma3_text",
]
LENGTHS = (9, 6, 13)  # one packed row of three documents
ALL_ON = {k: "on" for k in FAST_PATHS}


def tiny(model_type, attn="eager", dtype=torch.float32, seed=0, lora=None, **extra):
    """A tiny LoRA model (tests/tiny_models.py; small sliding windows and softcaps come with the
    architecture's tiny config): random norm weights, as Gemma's start at 0 (1 + w) and Llama's
    at 1 and both would hide bugs, and random LoRA B, as PEFT's zero B would hide dA."""
    return tiny_model(
        model_type, attn=attn, dtype=dtype, seed=seed, norm_std=0.2, lora=lora or {}, lora_b_std=0.2, **extra
    )


def packed_batch(seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    ids = torch.randint(0, vocab, (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def step(model, ids, pos, **kwargs):
    """Loss and LoRA gradients of one forward/backward over a packed row."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return out.loss.detach(), grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_step(got, ref, tol):
    (l1, g1), (l0, g0) = got, ref
    assert rel(l1, l0) <= tol, (l1.item(), l0.item())
    assert g1.keys() == g0.keys()
    worst = max(g0, key=lambda n: rel(g1[n], g0[n]))
    assert rel(g1[worst], g0[worst]) <= tol, (worst, rel(g1[worst], g0[worst]))
    assert any("lora_A" in n and g.abs().max() > 0 for n, g in g0.items())


def assert_all_on_but_kept(model_type, report):
    """Every fast path on, but those the architecture keeps stock: a plain up -> act -> down MLP
    (Arcee's ReLU²), a layer whose norms come after attention and the MLP (OLMo's)."""
    arch = arch_for(model_type)
    kept = {"lora_mlp": "MLP is not gated", "activations": "MLP is not gated"} if not arch.gated_mlp else {}
    if not arch.fused_add_norm:
        kept["add_rmsnorm"] = "decoder layer is not one it reproduces"
    assert {k: v for k, v in report.items() if k not in kept} == {k: "on" for k in FAST_PATHS if k not in kept}
    assert all(why in report[k] for k, why in kept.items()), report


@pytest.mark.parametrize("model_type", ARCHS)
def test_patched_matches_stock_fp32(model_type):
    model = tiny(model_type)
    ids, pos = packed_batch()
    ref = step(model, ids, pos)
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    assert_all_on_but_kept(model_type, report)
    assert_same_step(step(model, ids, pos), ref, 1e-4)
    # Packing matters: the same tokens as one document give a different loss.
    one_doc = step(model, ids, torch.arange(ids.shape[1]).unsqueeze(0))
    assert max(rel(one_doc[1][n], g) for n, g in ref[1].items()) > 1e-2


# -- attention kwargs reach whatever attention function is active ---------------------------------

RECORD = "tunesmith_test_record"
_calls: list = []


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    _calls.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()})
    eager = sys.modules[type(module).__module__].eager_attention_forward  # Gemma2's has softcap
    return eager(module, query, key, value, attention_mask, **kwargs)


def _register_recorder():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask
    except ImportError as exc:  # pragma: no cover - older transformers
        pytest.skip(f"attention registries unavailable: {exc}")
    AttentionInterface.register(RECORD, _recording_attention)
    AttentionMaskInterface.register(RECORD, eager_mask)


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3", "mistral", "ministral", "olmo3", "exaone4", "smollm3"])
def test_attention_kwargs_pass_through(model_type):
    """The patched forward hands the attention function exactly what the stock one does:
    scaling, dropout, sliding_window, softcap, and the packing kwargs of the collator."""
    _register_recorder()
    model = tiny(model_type, attn=RECORD)
    ids, pos = packed_batch()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    _calls.clear()
    ref = step(model, ids, pos, **packing)
    stock_calls = list(_calls)
    assert_all_on_but_kept(model_type, apply_fast_paths(model, FastPathConfig(), CPU))
    _calls.clear()
    got = step(model, ids, pos, **packing)
    assert_same_step(got, ref, 1e-4)
    assert len(_calls) == len(stock_calls) == 2
    for mine, theirs in zip(_calls, stock_calls):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            if torch.is_tensor(theirs[key]):
                assert torch.equal(mine[key], theirs[key]), key
            else:
                assert mine[key] == theirs[key], key
    assert "cu_seq_lens_q" in stock_calls[0] and "position_ids" in stock_calls[0]
    if model_type == "gemma2":
        assert stock_calls[0]["softcap"] == 20.0 and stock_calls[0]["sliding_window"] == 8


@pytest.mark.parametrize("model_type", ["qwen3", "exaone4", "olmo3"])
def test_packed_varlen_attention_from_engine(model_type):
    """With engine.fastpath.attention's packed varlen function active, patched == stock (it applies
    the window the attention module passes, so a window on the wrong layer shows)."""
    from engine.fastpath import attention, packed

    model = tiny(model_type)
    assert attention.enable_packed_attention(model) == "on"
    ids, _ = packed_batch()
    kwargs = packed.PackedSeqInfo.from_lengths(LENGTHS).model_kwargs()
    pos = kwargs.pop("position_ids")
    ref = step(model, ids, pos, **kwargs)
    assert_all_on_but_kept(model_type, apply_fast_paths(model, FastPathConfig(), CPU))
    assert_same_step(step(model, ids, pos, **kwargs), ref, 1e-4)


# -- checkpointing, bf16, the Triton path ---------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_gradient_checkpointing(model_type):
    model = tiny(model_type)
    ids, pos = packed_batch()
    ref = step(model, ids, pos)
    apply_fast_paths(model, FastPathConfig(), CPU)
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert model.get_base_model().model.gradient_checkpointing
    assert_same_step(step(model, ids, pos), ref, 1e-4)


def test_gemma3s_multimodal_wrapper_patches_its_language_model_only():
    """Gemma-3's 4B and larger load as Gemma3ForConditionalGeneration: its language model is the
    text model's modules (patched, the same loss and gradients as stock on a packed row); the
    vision tower's modules keep their own forwards."""
    model = tiny("gemma3")
    assert type(model.base_model.model).__name__ == "Gemma3ForConditionalGeneration"
    for name, p in model.named_parameters():  # text rows: the vision tower's adapters get no gradient
        if "language_model" not in name:
            p.requires_grad_(False)
    ids, pos = packed_batch(vocab=model.base_model.model.config.get_text_config().vocab_size - 3)
    ref = step(model, ids, pos)
    assert_all_on_but_kept("gemma3", apply_fast_paths(model, FastPathConfig(), CPU))
    assert_same_step(step(model, ids, pos), ref, 1e-4)
    language = model.base_model.model.model.language_model
    vision = model.base_model.model.model.vision_tower
    assert all(patching.installed(layer, "patches") is not None for layer in language.layers)
    assert not any(patching.installed(m, "patches") for m in vision.modules())


def test_bf16_within_rounding():
    """bf16 patched vs bf16 stock, both against fp32 stock on the same weights."""
    model16 = tiny("qwen3", dtype=torch.bfloat16)
    model32 = copy.deepcopy(model16).float()
    ids, pos = packed_batch()
    ref = step(model32, ids, pos)
    stock = step(model16, ids, pos)
    apply_fast_paths(model16, FastPathConfig(), CPU)
    got = step(model16, ids, pos)
    assert rel(got[0], ref[0]) <= 2 * rel(stock[0], ref[0]) + 2e-3
    for n in ref[1]:
        assert rel(got[1][n], ref[1][n]) <= 2 * rel(stock[1][n], ref[1][n]) + 1e-2, n


@pytest.mark.parametrize("model_type", ["qwen3", "olmo3", "smollm3", "exaone4", "gemma3_text"])
def test_triton_kernels_through_interpreter(model_type):
    """kernel_impl="triton": RMSNorm, in-place RoPE (after Qwen3's and Gemma-3's (1 + w) per-head and
    OLMo's whole-projection q/k norms; skipped on SmolLM3's NoPE layer) and the gated activation run as Triton kernels,
    through the interpreter on a CPU."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = tiny(model_type, num_hidden_layers=1) if model_type == "qwen3" else tiny(model_type)
    ids, pos = packed_batch()
    ref = step(model, ids, pos)
    assert_all_on_but_kept(model_type, apply_fast_paths(model, FastPathConfig(), CPU, kernel_impl="triton"))
    assert_same_step(step(model, ids, pos), ref, 1e-4)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "exaone4", "gemma3_text"])
def test_per_head_qk_norms_fuse_with_the_rotation(model_type):
    """fast_paths.qk_norm_rope: the per-head q/k norms and RoPE as one kernel give the step of the
    unfused kernels (through the interpreter on a CPU), on every layer that rotates; trained norm
    weights keep the unfused path, counted with the reason, and OLMo's whole-projection norms never fuse."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = tiny(model_type)
    ids, pos = packed_batch()
    apply_fast_paths(model, FastPathConfig(qk_norm_rope=False), CPU, kernel_impl="triton")
    reset_counters()
    apart = step(model, ids, pos)
    assert reset_counters().get("qk_norm_rope:triton", 0) == 0
    rotating = sum(arch_for(model_type).uses_rope(m) for m in model.modules() if hasattr(m, "q_norm"))
    assert rotating >= 1

    apply_fast_paths(model, FastPathConfig(), CPU, kernel_impl="triton")
    reset_counters()
    fused = step(model, ids, pos)
    counts = reset_counters()
    assert counts.get("qk_norm_rope:triton") == rotating
    assert_same_step(fused, apart, 1e-5)

    q_norm = next(m.q_norm for m in model.modules() if hasattr(m, "q_norm"))
    q_norm.weight.requires_grad_(True)
    try:
        reset_counters()
        step(model, ids, pos)
        counts = reset_counters()
        assert counts.get("fallback:qk_norm_rope: q/k norm weights are trained") == 1
        assert counts.get("qk_norm_rope:triton", 0) == rotating - 1
    finally:
        q_norm.weight.requires_grad_(False)


def test_whole_projection_qk_norms_do_not_fuse():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = tiny("olmo2")
    ids, pos = packed_batch()
    apply_fast_paths(model, FastPathConfig(), CPU, kernel_impl="triton")
    reset_counters()
    step(model, ids, pos)
    counts = reset_counters()
    assert counts.get("qk_norm_rope:triton", 0) == 0 and counts.get("rope:triton") > 0


# -- what stays stock, and why ------------------------------------------------------------------


def test_unknown_architecture_keeps_stock_path():
    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=2, target_modules=["c_attn"]))
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    assert report == {k: "off: model_type 'gpt2' has no patch" for k in FAST_PATHS}
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_lora_dropout_keeps_peft_path_with_reason():
    model = tiny("llama", lora=dict(lora_dropout=0.1))
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    for key in ("lora_qkv", "lora_o", "lora_mlp"):
        assert report[key] == "off: lora dropout 0.1 > 0"
    assert report["rmsnorm"] == report["rope"] == report["activations"] == "on"
    model.eval()  # dropout inactive: the kernel-only patches must still match stock
    ids, pos = packed_batch()
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits
        remove_fast_paths(model)
        ref = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_partial_targets_and_switches():
    model = tiny("qwen2", lora=dict(target_modules=["q_proj", "v_proj"]))
    report = apply_fast_paths(model, FastPathConfig(kernels=False), CPU)
    assert report["lora_qkv"] == "on"  # k_proj (no LoRA) runs base-only inside the fused group
    assert report["lora_o"] == "off: no LoRA adapter on these projections"
    assert report["lora_mlp"] == "off: no LoRA adapter on these projections"
    assert report["rmsnorm"] == report["rope"] == "off: fast_paths.kernels is false"
    ids, pos = packed_batch()
    remove_fast_paths(model)
    ref = step(model, ids, pos)
    apply_fast_paths(model, FastPathConfig(kernels=False), CPU)
    assert_same_step(step(model, ids, pos), ref, 1e-4)

    report = apply_fast_paths(model, FastPathConfig(lora_autograd=False), CPU)
    assert report["lora_qkv"] == "off: fast_paths.lora_autograd is false"
    assert report["rope"] == "on"
    report = apply_fast_paths(model, FastPathConfig(), torch.device("meta"))
    assert report["rmsnorm"].startswith("off: auto") and report["lora_qkv"].startswith("off: auto")


def test_one_unsupported_layer_gives_partial_report():
    model = tiny("llama")
    layer0 = model.get_base_model().model.layers[0]
    layer0.mlp.up_proj.lora_dropout["default"] = torch.nn.Dropout(0.2)
    report = apply_fast_paths(model, FastPathConfig(), CPU)
    assert report["lora_mlp"] == "partial 1/2: lora dropout 0.2 > 0"
    assert report["activations"] == "on"  # that MLP still uses the activation kernel


def test_runtime_fallbacks_and_removal():
    model = tiny("gemma")
    ids, pos = packed_batch()
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
        with model.disable_adapter():
            ref_base = model(input_ids=ids, position_ids=pos).logits
        cache_ref = model(input_ids=ids[:, :9], use_cache=True)
        next_ref = model(input_ids=ids[:, 9:10], past_key_values=cache_ref.past_key_values, use_cache=True).logits

        apply_fast_paths(model, FastPathConfig(), CPU)
        apply_fast_paths(model, FastPathConfig(), CPU)  # again: replaces, never stacks
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits, ref, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():  # the fused path with the LoRA term left out
            got = model(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(got, ref_base, rtol=1e-5, atol=1e-5)
        cache = model(input_ids=ids[:, :9], use_cache=True)
        nxt = model(input_ids=ids[:, 9:10], past_key_values=cache.past_key_values, use_cache=True).logits
        torch.testing.assert_close(nxt, next_ref, rtol=1e-5, atol=1e-5)

    patched = [m for m in model.modules() if patching.installed(m) is not None]
    assert len(patched) == 2 * 5 + 1  # per layer: the layer, 2 norms, attention, MLP; plus the final norm
    assert remove_fast_paths(model) == len(patched)
    assert not any("forward" in m.__dict__ for m in model.modules())


def _foreign_marks(model) -> list[str]:
    """`_tunesmith*` attributes on modules and configs, which belong to other libraries."""
    found = []
    for name, m in model.named_modules():
        for holder, what in ((m, name), (getattr(m, "config", None), f"{name}.config")):
            for attr in getattr(holder, "__dict__", {}):
                if attr.startswith("_tunesmith") or attr.startswith("tunesmith"):
                    found.append(f"{what}.{attr}")
    return found


def test_patches_leave_no_marks_on_transformers_objects_and_survive_deepcopy():
    model = tiny("qwen3")
    ids, pos = packed_batch()
    assert enable_packed_attention(model) == "on"
    assert apply_fast_paths(model, FastPathConfig(), CPU) == ALL_ON
    assert _foreign_marks(model) == []
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits

    twin = copy.deepcopy(model)
    assert _foreign_marks(twin) == []
    n_patched = sum(patching.installed(m) is not None for m in model.modules())
    # per layer: the layer (add_rmsnorm), 2 norms, q/k norms, attention, MLP; plus the final norm
    assert n_patched == 2 * 7 + 1
    assert sum(patching.installed(m) is not None for m in twin.modules()) == n_patched
    # Each copied forward runs on its own module: change the copy's adapters, the original keeps its output.
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids, position_ids=pos).logits, ref, rtol=1e-5, atol=1e-5)
        for n, p in twin.named_parameters():
            if "lora_B" in n:
                p.zero_()
        twin_out = twin(input_ids=ids, position_ids=pos).logits
        with twin.disable_adapter():
            twin_base = twin(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(twin_out, twin_base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits, ref, rtol=0, atol=0)

    assert remove_fast_paths(model) == n_patched
    assert disable_packed_attention(model).startswith("restored")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_describe_fast_paths_by_model_type():
    from engine.models.patches import FAST_PATHS, describe_fast_paths

    on = describe_fast_paths("qwen3")
    assert all(on[name] == "on" for name in FAST_PATHS) and on["packed_attention"] == "on"
    off = describe_fast_paths("gpt2")
    assert all(off[name].startswith("off: model_type 'gpt2'") for name in FAST_PATHS)
    assert off["fused_ce"] == "on" and "moe_grouping" not in off
    moe = describe_fast_paths("qwen3_moe")
    assert moe["moe_grouping"] == "on" and moe["lora_qkv"] == "on" and moe["lora_mlp"].startswith("off: the MoE")
    assert describe_fast_paths("gpt_oss")["moe_grouping"] == "on"
    # Whether a family packs several documents into one forward is said before any run.
    assert on["packed_rows"] == "on" and describe_fast_paths("gpt_oss")["packed_rows"] == "on"
    assert describe_fast_paths("lfm2")["packed_rows"].startswith("off: its layers carry state along a row")
    assert "each document of a row runs as its own forward" in describe_fast_paths("mpt")["packed_rows"]
