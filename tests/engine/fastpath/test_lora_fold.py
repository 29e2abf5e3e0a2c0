"""LoRA's rank product folded into the base GEMM (engine.fastpath.lora_fold): y = [x | xA^T][W | sB]^T.

Checked against PEFT's own autograd (fp32, tight) and against the same Functions unfolded; over
optimizer steps on a whole tiny model (the spare columns must follow every update of B); with an
input whose producer left spare columns (claimed once, no copy); and where the fold cannot run (a
moved weight, adapters off, 4-bit bases, a projection without LoRA), which keeps the plain path.
FOLD_MIN_ROWS is lowered so the CPU's small inputs fold.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from engine.config import FastPathConfig
from engine.counters import Counters, reset_counters
from engine.data.collate import PackedBatch
from engine.fastpath import lora as lora_mod
from engine.fastpath import lora_fold, recompute
from engine.fastpath.lora import GatedAct, lora_linears, lora_mlp
from engine.fastpath.lora_group import LoRAGroup, lora_parts, watch_optimizer
from engine.kernels.rmsnorm import spare_empty
from engine.models.patches import apply_fast_paths
from engine.train.step import forward_loss, prepare_model
from tests.engine.fastpath.test_lora_autograd import (
    HIDDEN,
    assert_close_all,
    inner,
    make_block,
    mlp_stock_for,
    qkv_stock,
    run,
)
from tests.engine.models.test_patches import CPU, assert_same_step, packed_batch, step, tiny
from tests.tiny_models import tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _fold_small_inputs(monkeypatch):
    monkeypatch.setattr(lora_fold, "FOLD_MIN_ROWS", 1)
    # o's and down's fold by rows is on by default; a developer's environment may say otherwise.
    monkeypatch.delenv("TUNESMITH_FOLD_ROWS", raising=False)


def _groups(block, fold=True, stacked=True):
    gate_up = LoRAGroup([lora_parts(block.gate_proj), lora_parts(block.up_proj)])
    down = LoRAGroup([lora_parts(block.down_proj)])
    qkv = LoRAGroup([lora_parts(m) for m in (block.q_proj, block.k_proj, block.v_proj)])
    if fold:
        assert lora_fold.fold_bases(gate_up, stacked=stacked)
        assert lora_fold.fold_bases(qkv, stacked=False)
    return gate_up, down, qkv


def _inputs(seed=1, shape=(3, 70)):
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _upstream(outs, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g) for o in outs]


def test_fold_bases_keeps_parameters_and_values():
    model = make_block(ALL)
    b = inner(model)
    layers = [getattr(b, n).get_base_layer() for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    params = [m.weight for m in layers]
    before = [p.detach().clone() for p in params]
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    gate_up, _, qkv = _groups(b)
    # Three rank-4 adapters: 12 columns, aligned to 16; two: 8.
    widths = [lora_fold.fold_width(qkv.ranks)] * 3 + [lora_fold.fold_width(gate_up.ranks)] * 2
    assert widths == [16, 16, 16, 8, 8]
    # The same Parameter objects and values, now views of buffers with spare columns after each row.
    assert [m.weight for m in layers] == params
    for p, v, width in zip(params, before, widths):
        assert torch.equal(p, v) and not p.requires_grad
        assert p.stride() == (HIDDEN + width, 1)
    gate, up = params[3], params[4]
    assert up.data_ptr() == gate.data_ptr() + gate.shape[0] * (HIDDEN + 8) * gate.element_size()
    assert params[0].untyped_storage().data_ptr() != params[1].untyped_storage().data_ptr()  # q/k/v apart
    for op in qkv.fold.operands(qkv.bases) + gate_up.fold.operands(gate_up.bases):
        assert not op[:, HIDDEN:].any()  # spare columns start at zero
    ptrs = [p.data_ptr() for p in params]
    assert lora_fold.fold_bases(qkv, stacked=False) and lora_fold.fold_bases(gate_up, stacked=True)
    assert [p.data_ptr() for p in params] == ptrs  # a second call copies nothing
    sd = model.state_dict()
    assert sd.keys() == sd_before.keys()
    for k in sd:
        assert torch.equal(sd[k], sd_before[k]), k


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "stacked_per_projection", "apart"])
def test_folded_groups_match_peft(bias, layout, monkeypatch):
    """q/k/v and the MLP folded give PEFT's outputs and gradients; each group's forward is one
    folded call (counted); the spare columns carry s*B after the first call."""
    if layout == "stacked_per_projection":
        monkeypatch.setattr(lora_mod, "STACKED_FORWARD_MAX_IN", HIDDEN - 1)
    model = make_block(ALL, bias=bias)
    ref = copy.deepcopy(model)
    gate_up, down, qkv = _groups(inner(model), stacked=layout != "apart")
    x = _inputs()
    with torch.no_grad():
        up_qkv = _upstream(qkv_stock(inner(ref), x))
    with Counters().active() as counts:
        got_qkv = run(model, lambda b, x: lora_linears(x, qkv), x, up_qkv)
        got_mlp = run(model, lambda b, x: (lora_mlp(x, gate_up, down, act=GatedAct("silu")),), x, _upstream([x]))
    assert counts["folded_gemm"] == 2
    # gate/up's input gradient through dy [W | sB] where d_gate and d_up lie side by side (stacked).
    assert counts["folded_gemm:dx"] == (0 if layout == "apart" else 1)
    assert counts["stacked_gemm"] == {"stacked": 2, "stacked_per_projection": 1, "apart": 0}[layout]
    assert_close_all(*got_qkv, *run(ref, qkv_stock, x, up_qkv), 1e-5)
    assert_close_all(*got_mlp, *run(ref, mlp_stock_for("silu"), x, _upstream([x])), 1e-5)
    b = inner(model)
    q = b.q_proj
    tail = qkv.fold.operands(qkv.bases)[0][:, HIDDEN : HIDDEN + 4]
    torch.testing.assert_close(tail, q.lora_B["default"].weight * q.scaling["default"])


def test_folded_input_gradient_matches_the_two_pass_one(monkeypatch):
    """Stacked gate/up's input gradient as dy [W | sB] in one GEMM (lora_fold.backward_dx) against
    dy sB and dy W apart: the same dx and adapter gradients; q/k/v keep the two passes; dx comes
    back as a column view of the wide output."""
    model = make_block(ALL, bias=True)
    gate_up, down, qkv = _groups(inner(model))
    x = _inputs(shape=(2, 90)).requires_grad_(True)
    got = {}
    for folded in (True, False):
        monkeypatch.setenv("TUNESMITH_FOLD_BACKWARD", "1" if folded else "0")
        model.zero_grad(set_to_none=True)
        x.grad = None
        with Counters().active() as counts:
            outs = lora_linears(x, qkv) + (lora_mlp(x, gate_up, down, act=GatedAct("silu")),)
            torch.autograd.backward(outs, _upstream(outs))
        assert counts["folded_gemm:dx"] == (1 if folded else 0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        got[folded] = (x.grad.clone(), grads)
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    for n in got[False][1]:
        torch.testing.assert_close(got[True][1][n], got[False][1][n], rtol=1e-5, atol=1e-5, msg=n)
    monkeypatch.setenv("TUNESMITH_FOLD_BACKWARD", "1")
    b = inner(model)
    w = gate_up.weights(
        [t for m in (b.gate_proj, b.up_proj) for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)],
        x.dtype,
    )
    dy_all = torch.randn(180, sum(m.out_features for m in gate_up.bases))
    dx, g = lora_fold.backward_dx(gate_up, w[0], w[1], dy_all)
    assert dx.shape == (180, HIDDEN) and dx.stride() == (gate_up.fold.ld, 1) and g.shape == (180, 8)
    assert lora_fold.backward_dx(gate_up, w[0], w[1], None) is None  # gradients not side by side


def test_spare_columns_are_claimed_once():
    """A producer's spare columns take xa without a copy; a second consumer of the same tensor
    finds none claimed and copies, and both get the right values."""
    model = make_block(ALL)
    ref = copy.deepcopy(model)
    gate_up, down, qkv = _groups(inner(model))
    width = lora_fold.fold_width(qkv.ranks)
    src = _inputs()
    x = spare_empty(src.shape, width, src.dtype, src.device)
    x.copy_(src)
    lora_fold.mark_spare(x, width)
    with torch.no_grad():
        outs = lora_linears(x, qkv)
        assert lora_fold.claim_spare(x) == 0  # claimed by the call
        wide = x.as_strided((x.shape[0] * x.shape[1], HIDDEN + width), (HIDDEN + width, 1))
        b = inner(ref)
        xa = torch.cat([src @ getattr(b, n).lora_A["default"].weight.t() for n in ("q_proj", "k_proj", "v_proj")], -1)
        torch.testing.assert_close(wide[:, HIDDEN : HIDDEN + 12], xa.reshape(-1, 12))  # xa written in place
        for o, w in zip(outs, qkv_stock(b, src)):
            torch.testing.assert_close(o, w)
        y = lora_mlp(x, gate_up, down, act=GatedAct("silu"))  # no spare left: copies
        torch.testing.assert_close(y, mlp_stock_for("silu")(b, src)[0])
        torch.testing.assert_close(wide[:, HIDDEN : HIDDEN + 12], xa.reshape(-1, 12))  # left alone


def test_unfoldable_calls_keep_the_plain_path(monkeypatch):
    """A weight moved after folding, adapters disabled, or fewer rows than FOLD_MIN_ROWS: the
    plain two-GEMM path with the same values."""
    model = make_block(ALL, bias=True)
    ref = copy.deepcopy(model)
    _, _, qkv = _groups(inner(model))
    b, rb = inner(model), inner(ref)
    x = _inputs()
    monkeypatch.setattr(lora_fold, "FOLD_MIN_ROWS", x.shape[0] * x.shape[1] + 1)
    with Counters().active() as counts, torch.no_grad():
        for o, w in zip(lora_linears(x, qkv), qkv_stock(rb, x)):
            torch.testing.assert_close(o, w)
    assert counts["folded_gemm"] == 0
    monkeypatch.setattr(lora_fold, "FOLD_MIN_ROWS", 1)
    with Counters().active() as counts, torch.no_grad(), model.disable_adapter():
        for o, m in zip(lora_linears(x, qkv), (b.q_proj, b.k_proj, b.v_proj)):
            torch.testing.assert_close(o, F.linear(x, m.base_layer.weight, m.base_layer.bias))
    assert counts["folded_gemm"] == 0
    b.k_proj.base_layer.weight.data = b.k_proj.base_layer.weight.detach().clone()  # what .to() does
    assert not qkv.fold.folded(qkv.bases)
    with Counters().active() as counts, torch.no_grad():
        for o, w in zip(lora_linears(x, qkv), qkv_stock(rb, x)):
            torch.testing.assert_close(o, w)
    assert counts["folded_gemm"] == 0


def test_what_cannot_fold_is_left_alone():
    model = make_block(["q_proj", "v_proj", "gate_proj", "up_proj"])
    b = inner(model)
    qkv = LoRAGroup([lora_parts(m) for m in (b.q_proj, b.k_proj, b.v_proj)])
    ptr = b.q_proj.base_layer.weight.data_ptr()
    assert "no LoRA" in lora_fold.fold_reason(qkv.bases, qkv.ranks)
    assert not lora_fold.fold_bases(qkv, stacked=False) and qkv.fold is None
    assert b.q_proj.base_layer.weight.data_ptr() == ptr
    gate_up = LoRAGroup([lora_parts(b.gate_proj), lora_parts(b.up_proj)])
    b.up_proj.base_layer.weight.requires_grad_(True)
    assert lora_fold.fold_reason(gate_up.bases, gate_up.ranks) is not None


def _prepared(fold: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_model("llama", lora={}, lora_b_std=0.1)
    prepare_model(model, FastPathConfig(kernels=False, fold_lora=fold), "cpu", gradient_checkpointing=False)
    return model


def test_a_prepared_model_folds_and_learns_the_same_over_steps():
    """fold_lora on and off, three AdamW steps each: the same losses and gradients at every step,
    so the spare columns follow every update of B and the rows below o's and down's W every update
    of A (the weight cache rewrites them)."""
    on, off = _prepared(True), _prepared(False)
    off.load_state_dict(on.state_dict())
    attn = on.base_model.model.model.layers[0].self_attn
    assert attn.q_proj.get_base_layer().weight.stride(0) > attn.q_proj.get_base_layer().in_features
    ids = torch.randint(0, on.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    opts = {}
    for name, model in (("on", on), ("off", off)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        watch_optimizer(opt, model)
        opts[name] = opt
    for _ in range(3):
        results = {}
        for name, model in (("on", on), ("off", off)):
            with Counters().active() as counts:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            assert (counts["folded_gemm"] > 0) == (name == "on")
            assert (counts["folded_gemm:rows"] > 0) == (name == "on")  # A's rows below W follow each update
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            results[name] = (loss.detach(), grads)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        torch.testing.assert_close(results["on"][0], results["off"][0], rtol=1e-5, atol=1e-6)
        for n in results["off"][1]:
            torch.testing.assert_close(results["on"][1][n], results["off"][1][n], rtol=1e-4, atol=1e-6, msg=n)


def test_auto_folds_narrow_inputs_only(monkeypatch):
    """fast_paths.fold_lora: auto folds inputs up to AUTO_MAX_IN wide; true at any width; false never."""
    monkeypatch.setattr(lora_fold, "AUTO_MAX_IN", HIDDEN - 1)
    b = inner(make_block(ALL))
    qkv = LoRAGroup([lora_parts(m) for m in (b.q_proj, b.k_proj, b.v_proj)])
    assert "auto folds inputs up to" in lora_fold.fold_reason(qkv.bases, qkv.ranks, "auto")
    assert not lora_fold.fold_bases(qkv, False, "auto") and qkv.fold is None
    assert not lora_fold.fold_bases(qkv, False, False)
    assert lora_fold.fold_bases(qkv, False, True) and qkv.fold is not None


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gemma3_text"])
def test_patched_norms_leave_the_spare_columns(model_type):
    """With the Triton kernels (the interpreter on a CPU) each layer's input norm and the MLP's norm
    (the fused add + norm where the layer has it) write their output with the folded group's spare
    columns: every folded forward puts xA^T there, none copies its input, and the step is the
    unfolded one's."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = tiny(model_type)
    ids, pos = packed_batch()
    apply_fast_paths(model, FastPathConfig(fold_lora=False), CPU, kernel_impl="triton")
    apart = step(model, ids, pos)
    apply_fast_paths(model, FastPathConfig(), CPU, kernel_impl="triton")
    reset_counters()
    folded = step(model, ids, pos)
    counts = reset_counters()
    layers = model.config.num_hidden_layers
    assert counts["folded_gemm"] == 2 * layers  # q/k/v and gate/up of every layer
    assert counts.get("folded_gemm:copied", 0) == 0
    assert_same_step(folded, apart, 1e-5)


def test_a_norm_output_with_spare_columns_can_be_released():
    """The lean recompute frees the normed attention input once q/k/v have read it
    (recompute.release_remade): a norm's output with spare columns is still its storage's whole
    (what the consumer wrote there it keeps in a tensor of its own); a view into a shared buffer
    is not."""
    t = lora_fold.mark_spare(spare_empty((2, 5, 8), 8, torch.float32, "cpu"), 8)
    with recompute.remade_when_unpacked(t, lambda: t, True, True):
        assert recompute.release_remade(t)
    assert t.untyped_storage().nbytes() == 0
    for shared in (torch.empty(2, 5, 16)[..., 8:], torch.empty(2, 5, 16)[..., :8]):  # halves of someone's rows
        with recompute.remade_when_unpacked(shared, lambda: shared, True, True):
            assert not recompute.release_remade(shared)


@pytest.mark.parametrize("offload", ["single", "double"])
def test_the_lean_recompute_takes_inputs_with_spare_columns(offload, monkeypatch):
    """Offload's lean recompute remakes the normed attention input (with its spare columns) for
    q/k/v's backward and frees it once they are made; with the fold the step is the unfolded one's.
    The Triton kernels run through the interpreter on a CPU, so the norms leave spare columns."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    released, real_release = [], recompute.release_remade

    def release(x):
        released.append((x.stride(-2) > x.shape[-1], real_release(x)))
        return released[-1][1]

    monkeypatch.setattr(recompute, "release_remade", release)
    results = {}
    for fold in (False, True):
        released.clear()
        model = tiny("qwen3", attn="sdpa", num_hidden_layers=2)
        fast = FastPathConfig(lean_recompute=True, fold_lora=fold)
        prepared = prepare_model(model, fast, CPU, gradient_checkpointing=True, offload=offload)
        apply_fast_paths(model, fast, CPU, kernel_impl="triton")
        model.train()
        g = torch.Generator().manual_seed(3)
        docs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 12, 64, 9)]
        b = PackedBatch.from_documents(docs)
        with Counters().active() as counts:
            forward_loss(prepared, b, normalizer=b.num_trained_tokens).backward()
        assert (counts["folded_gemm"] > 0) == fold
        assert (counts["folded_gemm:rows"] > 0) == fold  # o's and down's input gradients (the lean MLP's tiles)
        # Each layer's recompute freed its normed input, with spare columns exactly when folded.
        freed = [spare for spare, done in released if done]
        assert len(freed) == 2 and all(spare == fold for spare in freed), released
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results[fold] = grads
    for n, want in results[False].items():
        torch.testing.assert_close(results[True][n], want, rtol=1e-4, atol=1e-6, msg=n)


def _row_groups(block):
    down = LoRAGroup([lora_parts(block.down_proj)])
    o = LoRAGroup([lora_parts(block.o_proj)])
    gate_up = LoRAGroup([lora_parts(block.gate_proj), lora_parts(block.up_proj)])
    assert lora_fold.fold_rows(down) and lora_fold.fold_rows(o)
    return gate_up, down, o


def test_fold_rows_keeps_parameters_and_puts_a_below_w():
    """o's and down's bases move into buffers `width` rows taller: the same Parameters and values,
    contiguous, with A (cast, unscaled) written below W when the weight cache builds, zeros under it."""
    model = make_block(ALL)
    b = inner(model)
    layers = [b.o_proj.get_base_layer(), b.down_proj.get_base_layer()]
    params = [m.weight for m in layers]
    before = [p.detach().clone() for p in params]
    _, down, o = _row_groups(b)
    for p, v in zip(params, before):
        assert torch.equal(p, v) and p.is_contiguous() and not p.requires_grad
    assert [m.weight for m in layers] == params
    ptrs = [p.data_ptr() for p in params]
    assert lora_fold.fold_rows(down) and [p.data_ptr() for p in params] == ptrs  # a second call copies nothing
    for group, proj in ((o, b.o_proj), (down, b.down_proj)):
        fold = group.row_fold
        assert fold.width == 8 and fold.rank == 4
        assert not fold.operand(group.bases[0])[fold.out_features :].any()  # before the first build
        group.weights(group.ab(), torch.float32)
        op = fold.operand(group.bases[0])
        torch.testing.assert_close(op[fold.out_features : fold.out_features + 4], proj.lora_A["default"].weight)
        assert not op[fold.out_features + 4 :].any()


def test_row_folded_input_gradients_match_the_two_pass_ones(monkeypatch):
    """o's input gradient (LoRALinears) and down's (LoRAMLP) as [dy | dy sB] [W; A] in one GEMM
    against (dy sB) A then dy W: the same dx and adapter gradients, and PEFT's; TUNESMITH_FOLD_ROWS=0
    keeps the two passes; a weight moved after folding runs unfolded."""
    model = make_block(ALL, bias=True)
    ref = copy.deepcopy(model)
    gate_up, down, o = _row_groups(inner(model))
    x = _inputs(shape=(2, 90)).requires_grad_(True)
    got = {}
    for folded in (True, False):
        monkeypatch.setenv("TUNESMITH_FOLD_ROWS", "1" if folded else "0")
        model.zero_grad(set_to_none=True)
        x.grad = None
        with Counters().active() as counts:
            outs = (lora_mlp(x, gate_up, down, act=GatedAct("silu")),) + lora_linears(x, o)
            torch.autograd.backward(outs, _upstream(outs))
        assert counts["folded_gemm:rows"] == (2 if folded else 0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        got[folded] = (x.grad.clone(), grads)
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    for n in got[False][1]:
        torch.testing.assert_close(got[True][1][n], got[False][1][n], rtol=1e-5, atol=1e-5, msg=n)
    monkeypatch.setenv("TUNESMITH_FOLD_ROWS", "1")
    xr = x.detach().clone().requires_grad_(True)
    want = run(ref, mlp_stock_for("silu"), xr, _upstream([xr]))
    model.zero_grad(set_to_none=True)
    mlp = lambda blk, x: (lora_mlp(x, gate_up, down, act=GatedAct("silu")),)  # noqa: E731
    assert_close_all(*run(model, mlp, xr, _upstream([xr])), *want, 1e-5)
    b = inner(model)
    b.down_proj.base_layer.weight.data = b.down_proj.base_layer.weight.detach().clone()  # what .to() does
    assert not down.row_fold.folded(down.bases[0])
    with Counters().active() as counts:
        y = lora_mlp(x, gate_up, down, act=GatedAct("silu"))
        y.backward(torch.ones_like(y))
    assert counts["folded_gemm:rows"] == 0


def test_auto_folds_rows_of_narrow_models_only(monkeypatch):
    """fold_rows: auto up to AUTO_MAX_IN wide outputs (the model's width, the GEMM's depth); true at
    any width; false never; a projection without LoRA or a trainable base never."""
    monkeypatch.setattr(lora_fold, "AUTO_MAX_IN", HIDDEN - 1)
    b = inner(make_block(["q_proj", "o_proj"]))
    o = LoRAGroup([lora_parts(b.o_proj)])
    assert not lora_fold.fold_rows(o, "auto") and o.row_fold is None
    assert not lora_fold.fold_rows(o, False)
    assert lora_fold.fold_rows(o, True) and o.row_fold is not None
    down = LoRAGroup([lora_parts(b.down_proj)])  # no adapter on it
    assert not lora_fold.fold_rows(down, True) and down.row_fold is None
    monkeypatch.setenv("TUNESMITH_FOLD_ROWS", "0")  # bench's before/after: nothing moved
    o = LoRAGroup([lora_parts(inner(make_block(["o_proj"])).o_proj)])
    w = o.bases[0].weight
    assert not lora_fold.fold_rows(o, True) and o.row_fold is None and w.untyped_storage().nbytes() == w.nbytes
    monkeypatch.delenv("TUNESMITH_FOLD_ROWS")  # the default: folded
    assert lora_fold.fold_rows(o, True) and o.row_fold is not None
