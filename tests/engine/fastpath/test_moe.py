"""engine.fastpath.moe on a CPU: the grouped forward of Qwen3-MoE and GPT-OSS blocks against the stock
transformers blocks (fp32, output and input gradient, experts that get no tokens, a trainable
router), the Triton kernels through the interpreter, host syncs of the routing, the model-level
patch with LoRA on attention, and the W5 bench plumbing on a tiny block."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.fastpath import moe
from engine.fastpath.moe import apply_moe_grouping, block_unsupported_reason, group_block, remove_moe_grouping
from tests.tiny_models import tiny_config, tiny_model

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 8, 2
IMPLS = [("loop", "torch"), ("grouped_mm", "torch"), ("loop", "triton")]


def _config(arch: str, **extra):
    shape = dict(hidden_size=HIDDEN, head_dim=8, num_experts_per_tok=TOP_K, vocab_size=64, max_position_embeddings=128)
    if arch == "qwen3_moe":
        shape.update(moe_intermediate_size=INTER, intermediate_size=48, num_experts=EXPERTS)
    else:
        shape.update(intermediate_size=INTER, num_local_experts=EXPERTS)
    cfg = tiny_config(arch, **{**shape, **extra})
    cfg._experts_implementation = "eager"
    cfg.use_cache = False
    return cfg


def _block(arch: str, seed: int = 0, **extra):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = Qwen3MoeSparseMoeBlock if arch == "qwen3_moe" else GptOssMLP
    torch.manual_seed(seed)
    block = cls(_config(arch, **extra))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)  # large enough that GPT-OSS's clamps bite
        p.requires_grad_(False)
    if arch == "gpt_oss":
        block.experts.limit = 0.75  # both sides of both clamps occur at this scale
    return block


def _run(block, x, g):
    x = x.clone().requires_grad_(True)
    out = block(x)
    scores = None
    if isinstance(out, tuple):
        out, scores = out
    out.backward(g)
    return out.detach(), x.grad, scores


def _close(a, b, rel=1e-5):
    err = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
    assert err <= rel, f"norm-relative error {err:.3e} > {rel:.0e}"


def _expert_counts(block, x):
    router = block.gate if hasattr(block, "gate") else block.router
    with torch.no_grad():
        _, _, idx = router(x.reshape(-1, HIDDEN))
    return torch.bincount(idx.reshape(-1), minlength=EXPERTS)


@pytest.mark.parametrize("impl,kernels", IMPLS)
@pytest.mark.parametrize("arch,extra", [("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False}), ("gpt_oss", {})])
@pytest.mark.parametrize("tokens", [3, 40])
def test_grouped_block_matches_hf(arch, extra, impl, kernels, tokens):
    if impl == "grouped_mm" and moe._GMM is None:
        pytest.skip("this torch has no grouped_mm")
    ref = _block(arch, **extra)
    ours = group_block(copy.deepcopy(ref), impl=impl, kernels=kernels)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, HIDDEN, generator=gen)
    g = torch.randn(1, tokens, HIDDEN, generator=gen)
    if tokens == 3:  # 6 (token, slot) pairs over 8 experts: some experts get no token
        assert (_expert_counts(ref, x) == 0).any()
    out_ref, gx_ref, s_ref = _run(ref, x, g)
    out, gx, s = _run(ours, x, g)
    _close(out, out_ref)
    _close(gx, gx_ref)  # includes the path through the router's scores
    if s_ref is not None:
        assert torch.equal(s, s_ref)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_trainable_router_gets_hf_gradients(arch):
    ref = _block(arch)
    router = "gate" if arch == "qwen3_moe" else "router"
    for p in getattr(ref, router).parameters():
        p.requires_grad_(True)
    ours = group_block(copy.deepcopy(ref))
    x, g = torch.randn(2, 9, HIDDEN), torch.randn(2, 9, HIDDEN)
    _run(ref, x, g)
    _run(ours, x, g)
    theirs, mine = dict(getattr(ref, router).named_parameters()), dict(getattr(ours, router).named_parameters())
    assert theirs and list(mine) == list(theirs)  # the same parameters, none left out
    for name, a in theirs.items():
        _close(mine[name].grad, a.grad)


def test_trainable_experts_take_the_stock_forward():
    block = _block("qwen3_moe")
    block.experts.gate_up_proj.requires_grad_(True)
    assert "trainable" in block_unsupported_reason(block)
    group_block(block)
    moe.reset_counters()
    block(torch.randn(1, 4, HIDDEN)).sum().backward()
    counts = moe.reset_counters()
    assert counts["moe_calls"] == 0  # the runtime check fell back, and says why
    assert counts["fallback:moe: trainable experts"] == 1
    assert block.experts.gate_up_proj.grad is not None


# -- host syncs -------------------------------------------------------------------------------------

_READS_HOST = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero")
_TORCH_READS_HOST = ("nonzero", "unique", "unique_consecutive", "bincount", "masked_select", "argwhere")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts calls that read a tensor's values on the host (a device sync on CUDA): Tensor
    methods and torch functions, wherever called from (forward or backward)."""
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name in _READS_HOST:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name in _TORCH_READS_HOST:
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name)))
    where = torch.where

    def where_counted(*args, **kwargs):
        if len(args) + len(kwargs) == 1:  # torch.where(mask) is nonzero
            calls.append("where")
        return where(*args, **kwargs)

    monkeypatch.setattr(torch, "where", where_counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_routing_reads_the_host_at_most_once(arch, host_reads):
    stock = _block(arch)
    ours = group_block(copy.deepcopy(stock), impl="loop")
    x, g = torch.randn(1, 40, HIDDEN), torch.randn(1, 40, HIDDEN)
    _run(stock, x, g)
    assert len(host_reads) > 2  # the sniffer sees the stock eager loop's per-expert reads
    host_reads.clear()
    moe.reset_counters()
    _run(ours, x, g)
    assert host_reads == ["tolist"]  # one read per block call, forward and backward together
    assert moe.reset_counters() == {"metadata_builds": 0, "moe_calls": 1, "host_syncs": 1, "moe:loop": 1}
    if moe._GMM is not None:
        grouped = group_block(copy.deepcopy(stock), impl="grouped_mm")
        host_reads.clear()
        _run(grouped, x, g)
        assert host_reads == []  # grouped_mm takes the offsets on the device
        assert moe.reset_counters() == {"metadata_builds": 0, "moe_calls": 1, "host_syncs": 0, "moe:grouped_mm": 1}


# -- whole models ---------------------------------------------------------------------------------------


def _model(arch: str, **extra):
    model = tiny_model(arch, attn="sdpa" if arch != "gpt_oss" else "eager", config=_config(arch, **extra))
    with torch.no_grad():  # routers start at zero (every expert ties); give them some spread
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def _lora_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_model_with_lora_on_attention_matches_stock(arch):
    from engine.config import LoraConfig
    from engine.models.lora import attach_lora

    cfg = LoraConfig(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    stock = attach_lora(_model(arch), cfg)
    with torch.no_grad():  # non-zero B so every LoRA parameter has a gradient worth comparing
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    ours = copy.deepcopy(stock)
    assert apply_moe_grouping(ours) == "on"
    for m in (stock, ours):
        m.train()
        m.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    loss_ref, grads_ref = _lora_step(stock, ids)
    moe.reset_counters()
    loss, grads = _lora_step(ours, ids)
    counts = moe.reset_counters()
    layers = ours.config.num_hidden_layers
    # Checkpointing runs each layer's forward twice; one host read per block call at most.
    assert counts["moe_calls"] == 2 * layers and counts["host_syncs"] <= counts["moe_calls"]
    _close(loss, loss_ref, rel=1e-5)  # grouped expert matmuls sum in another order
    assert grads.keys() == grads_ref.keys() and len(grads) == 8 * layers
    for n in grads:
        _close(grads[n], grads_ref[n], rel=1e-4)
    assert remove_moe_grouping(ours) == layers


def test_reports_partial_and_off():
    model = _model("qwen3_moe")
    model.model.layers[0].mlp.experts.down_proj.requires_grad_(True)
    for n, p in model.named_parameters():
        if "layers.0.mlp" not in n:
            p.requires_grad_(False)
    report = apply_moe_grouping(model)
    assert report.startswith("partial 1/2: ") and "trainable" in report
    assert apply_moe_grouping(_model("qwen3_moe", mlp_only_layers=[0, 1])) == "off: no MoE blocks in this model"
    qwen2 = tiny_model("qwen2_moe", num_hidden_layers=1)  # routed experts and a shared one
    assert apply_moe_grouping(qwen2).startswith("off: Qwen2MoeSparseMoeBlock is not a supported MoE block")


# -- the W5 bench on a tiny block -----------------------------------------------------------------------


def test_bench_runs_ours_and_every_hf_experts_impl():
    from bench.__main__ import plan_impls, setup_for
    from bench.batches import make_batches
    from bench.runner import Budget, Context, run_impl
    from bench.workloads import WORKLOADS

    w5 = WORKLOADS["W5"]
    tiny = w5.with_changes(
        id="W5-tiny",
        tokens=64,
        config=dict(
            w5.config,
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
        ),
    )
    batches = make_batches(3, tiny.tokens, 64, tiny.packing)
    ctx = Context(tiny, batches, torch.device("cpu"), warmup=1, steps=2, budget=Budget(None))
    plan = plan_impls(tiny, ["ours", "hf"], ["all-on", "no-moe-grouping"])
    impls = [i for i, _ in plan]
    assert impls[:2] == ["ours", "ours"] and "hf_moe_eager" in impls
    recs = {(i, o.get("variant")): run_impl(setup_for(i, o), ctx, i, {}, o) for i, o in plan}
    for key, rec in recs.items():
        assert rec["status"] == "ok", (key, rec["status"])
        assert rec["tokens_per_s"] > 0
    on = recs[("ours", "all-on")]["options"]
    assert on["moe_grouping"] == "on" and on["expert_matmuls"] == "loop"
    assert on["routing_host_syncs_per_call"] <= 1
    assert recs[("ours", "no-moe-grouping")]["options"]["moe_grouping"].startswith("off")


def test_plan_impls_keeps_train_workloads_unchanged():
    from bench.__main__ import plan_impls
    from bench.workloads import WORKLOADS

    plan = plan_impls(WORKLOADS["W1"], ["ours", "hf", "hf_flex"], ["all-on"])
    assert plan == [("ours", {"variant": "all-on"}), ("hf_sdpa", {}), ("hf_flex", {})]
    assert dataclasses.is_dataclass(WORKLOADS["W5"])


def test_second_backward_over_the_in_place_kernel_fails_loudly():
    block = group_block(_block("qwen3_moe"), impl="loop", kernels="triton")
    x = torch.randn(1, 6, HIDDEN, requires_grad=True)
    out = block(x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_default_lora_on_a_moe_model_leaves_experts_frozen_and_grouped():
    """The engine's "all-linear" targets Linear layers only (PEFT's would wrap the 3-D expert
    weights and the router too), so prepare_model groups every MoE block and patches attention."""

    from engine.config import FastPathConfig, LoraConfig
    from engine.models.lora import all_linear_names, attach_lora
    from engine.train.step import prepare_model

    model = tiny_model("qwen3_moe")
    assert all_linear_names(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    peft_model = attach_lora(model, LoraConfig())
    assert not any("experts" in n or ".gate." in n for n, p in peft_model.named_parameters() if p.requires_grad)
    report = prepare_model(peft_model, FastPathConfig(), torch.device("cpu"), gradient_checkpointing=True).report
    assert report["moe_grouping"] == "on", report
    assert report["lora_qkv"] == "on" and report["lora_o"] == "on" and report["rmsnorm"] == "on"
