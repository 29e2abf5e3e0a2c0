"""Frozen bases stored back to back (engine.fastpath.lora_group.stack_bases): one GEMM for the
projections that share an input, with the same values, gradients and memory as separate ones.

Checked against PEFT's own autograd (fp32, tight), against the same Functions with the bases
apart, and on a whole tiny model as a run prepares it: the fast path's switch stacks gate and up,
the loss and every LoRA gradient match the unstacked run, and a model whose weights were moved
after patching falls back to separate GEMMs instead of reading stale memory.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import FastPathConfig
from engine.counters import Counters
from engine.fastpath import lora as lora_mod
from engine.fastpath.lora import GatedAct, lora_linears, lora_mlp
from engine.fastpath.lora_group import LoRAGroup, lora_parts, stack_bases
from engine.train.step import prepare_model
from tests.engine.fastpath.test_lora_autograd import (
    HIDDEN,
    assert_close_all,
    inner,
    make_block,
    mlp_stock_for,
    qkv_stock,
    run,
)
from tests.tiny_models import tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _inputs(seed=1, shape=(3, 200)):
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _upstream(outs, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g) for o in outs]


def test_stack_bases_keeps_parameters_values_and_memory():
    block = inner(make_block(ALL))
    layers = [block.gate_proj.get_base_layer(), block.up_proj.get_base_layer()]
    params = [m.weight for m in layers]
    before = [p.detach().clone() for p in params]
    assert stack_bases(layers)
    # The same Parameter objects, the same values, now views of one buffer, one after the other.
    assert [m.weight for m in layers] == params
    for p, b in zip(params, before):
        assert torch.equal(p, b) and not p.requires_grad
    assert params[0].untyped_storage().data_ptr() == params[1].untyped_storage().data_ptr()
    assert params[1].data_ptr() == params[0].data_ptr() + params[0].numel() * params[0].element_size()
    assert params[0].untyped_storage().nbytes() == sum(p.numel() * p.element_size() for p in params)
    assert stack_bases(layers)  # a second call finds them stacked and copies nothing
    group = LoRAGroup([lora_parts(block.gate_proj), lora_parts(block.up_proj)])
    assert torch.equal(group.stacked_weight(), torch.cat(before))
    # A write through a parameter is a write into the stacked weight (checkpoint loads, merges).
    with torch.no_grad():
        params[1].add_(1.0)
    assert torch.equal(group.stacked_weight()[-params[1].shape[0] :], before[1] + 1.0)


def test_moved_weights_fall_back_to_separate_gemms():
    block = inner(make_block(ALL))
    gate, up = block.gate_proj.get_base_layer(), block.up_proj.get_base_layer()
    stack_bases([gate, up])
    group = LoRAGroup([lora_parts(block.gate_proj), lora_parts(block.up_proj)])
    assert group.stacked_weight() is not None
    up.weight.data = up.weight.detach().clone()  # what .to() / a cast does: a buffer of its own
    assert group.stacked_weight() is None


def test_unstackable_bases_are_left_alone():
    block = inner(make_block(ALL))
    gate, down = block.gate_proj.get_base_layer(), block.down_proj.get_base_layer()
    ptrs = (gate.weight.data_ptr(), down.weight.data_ptr())
    assert not stack_bases([gate, down])  # different input widths
    assert (gate.weight.data_ptr(), down.weight.data_ptr()) == ptrs
    assert not stack_bases([gate])


def _groups(block, stacked: bool):
    gate_up = LoRAGroup([lora_parts(block.gate_proj), lora_parts(block.up_proj)])
    down = LoRAGroup([lora_parts(block.down_proj)])
    qkv = LoRAGroup([lora_parts(m) for m in (block.q_proj, block.k_proj, block.v_proj)])
    if stacked:
        assert stack_bases(gate_up.bases) and stack_bases(qkv.bases)
    return gate_up, down, qkv


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("sliced", [False, True])
def test_stacked_mlp_matches_peft(impl, sliced, monkeypatch):
    """The MLP's forward and its input gradient each take one GEMM over [W_gate; W_up] (counted),
    with PEFT's outputs and gradients. impl "triton" runs the activation kernel (through the
    interpreter on the CPU; conftest sets it): its backward writes d_gate and d_up over the stacked
    output in place. `sliced`: the activation's backward a slice of rows at a time."""
    if sliced:
        monkeypatch.setattr(lora_mod, "MLP_SLICE_BYTES", 1)  # slices of 256 rows
    # On a GPU machine the kernel runs on the GPU (the interpreter is for machines without one).
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    model = make_block(ALL).to(dev)
    ref = copy.deepcopy(model)
    gate_up, down, _ = _groups(inner(model), stacked=True)
    x = _inputs().to(dev)
    up = [u.to(dev) for u in _upstream([x[..., :HIDDEN]])]
    act = GatedAct("silu", impl)
    with Counters().active() as counts:
        got = run(model, lambda b, x: (lora_mlp(x, gate_up, down, act=act),), x, up)
    assert counts["stacked_gemm"] == 2  # the forward's GEMM and the backward's
    assert (counts["activations:triton"] > 0) == (impl == "triton")
    want = run(ref, mlp_stock_for("silu"), x, up)
    assert_close_all(*got, *want, 1e-5 if dev == "cpu" else 1e-4)  # cuBLAS sums in its own order


@pytest.mark.parametrize("stack", [False, True])
def test_wide_inputs_take_one_forward_gemm_per_projection(stack, monkeypatch):
    """Above STACKED_FORWARD_MAX_IN the forward multiplies each projection into its column block
    (the same values), and the backward still takes one GEMM over the side-by-side gradients."""
    monkeypatch.setattr(lora_mod, "STACKED_FORWARD_MAX_IN", HIDDEN - 1)
    model = make_block(ALL, bias=True)
    ref = copy.deepcopy(model)
    gate_up, down, qkv = _groups(inner(model), stacked=stack)
    x = _inputs()
    up = _upstream([x[..., :HIDDEN]])
    with Counters().active() as counts:
        got = run(model, lambda b, x: (lora_mlp(x, gate_up, down, act=GatedAct("silu")),), x, up)
    assert counts["stacked_gemm"] == (1 if stack else 0)  # the backward's
    assert_close_all(*got, *run(ref, mlp_stock_for("silu"), x, up), 1e-5)
    with model.disable_adapter(), torch.no_grad():  # the base alone, with biases
        outs = lora_linears(x, qkv)
        b = inner(model)
        for o, m in zip(outs, (b.q_proj, b.k_proj, b.v_proj)):
            torch.testing.assert_close(o, torch.nn.functional.linear(x, m.base_layer.weight, m.base_layer.bias))


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_qkv_matches_peft(bias):
    """A q/k/v group over stacked bases (bias included) gives PEFT's outputs and gradients; its
    outputs are column blocks of one tensor, and gradients that arrive apart take the separate
    GEMMs."""
    model = make_block(ALL, bias=bias)
    ref = copy.deepcopy(model)
    _, _, qkv = _groups(inner(model), stacked=True)
    x = _inputs()
    outs = lora_linears(x, qkv)
    assert outs[0].stride()[-2] == sum(o.shape[-1] for o in outs)
    up = _upstream(outs)
    with Counters().active() as counts:
        got = run(model, lambda b, x: lora_linears(x, qkv), x, up)
    assert counts["stacked_gemm"] == 1  # the forward; the three gradients came apart
    assert_close_all(*got, *run(ref, qkv_stock, x, up), 1e-5)


def test_stacked_with_adapters_disabled_is_the_base():
    model = make_block(ALL, bias=True)
    _, _, qkv = _groups(inner(model), stacked=True)
    x = _inputs()
    b = inner(model)
    with model.disable_adapter(), torch.no_grad():
        got = lora_linears(x, qkv)
        want = [
            torch.nn.functional.linear(x, m.base_layer.weight, m.base_layer.bias)
            for m in (b.q_proj, b.k_proj, b.v_proj)
        ]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def _prepared(stacked):
    model = tiny_model("llama", lora={}, lora_b_std=0.1)
    prepare_model(model, FastPathConfig(kernels=False, stacked_bases=stacked), "cpu", gradient_checkpointing=False)
    return model


def _loss_and_grads(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_prepared_model_stacks_gate_and_up_and_learns_the_same():
    on, off = _prepared(True), _prepared(False)
    mlp_on = on.base_model.model.model.layers[0].mlp
    gate, up = mlp_on.gate_proj.get_base_layer().weight, mlp_on.up_proj.get_base_layer().weight
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    mlp_off = off.base_model.model.model.layers[0].mlp
    assert (
        mlp_off.gate_proj.get_base_layer().weight.untyped_storage().data_ptr()
        != mlp_off.up_proj.get_base_layer().weight.untyped_storage().data_ptr()
    )
    with Counters().active() as counts:
        loss_on, grads_on = _loss_and_grads(on)
    assert counts["stacked_gemm"] == 4  # 2 layers x (forward + backward)
    loss_off, grads_off = _loss_and_grads(off)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for n in grads_off:
        torch.testing.assert_close(grads_on[n], grads_off[n], rtol=1e-5, atol=1e-6, msg=n)
    # The state dict is the same tensors by name and value: what a save or a merge reads.
    sd_on, sd_off = on.state_dict(), off.state_dict()
    assert sd_on.keys() == sd_off.keys()
    for k in sd_off:
        assert torch.equal(sd_on[k], sd_off[k]), k
