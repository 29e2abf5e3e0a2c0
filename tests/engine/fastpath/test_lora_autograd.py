"""Fused LoRA Functions (engine.fastpath.lora, over engine.fastpath.lora_group) against PEFT's own autograd.

Each case builds a small block of projections, wraps it with PEFT (B initialised randomly so
every gradient is non-trivial), and compares outputs and gradients of x, A and B between
PEFT's path and the fused Functions: fp32 tightly, bf16 against an fp64 reference with the
fused error bounded by PEFT's own bf16 error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from engine.fastpath.lora import GatedAct, lora_linears, lora_mlp
from engine.fastpath.lora_group import lora_parts, lora_unsupported_reason, runtime_ok

HIDDEN, INTER, HEADS_Q, HEADS_KV, HEAD_DIM = 48, 80, 4, 2, 12


class Block(nn.Module):
    """The projections of one decoder layer, named as in Llama."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS_Q * HEAD_DIM, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, HEADS_KV * HEAD_DIM, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, HEADS_KV * HEAD_DIM, bias=bias)
        self.o_proj = nn.Linear(HEADS_Q * HEAD_DIM, HIDDEN, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)


def make_block(targets, bias=False, seed=0, dtype=torch.float32, **lora_kwargs):
    torch.manual_seed(seed)
    block = Block(bias=bias)
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    cfg.update(lora_kwargs)
    model = get_peft_model(block, LoraConfig(**cfg))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; random B makes dA and dx non-trivial
            nn.init.normal_(p, std=0.2)
    return model.to(dtype)


def inner(model):
    return model.base_model.model


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def run(model, fn, x, upstream):
    """Outputs and gradients (x + every LoRA parameter) of fn(block, x) with upstream grads."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    outs = fn(inner(model), x)
    torch.autograd.backward(outs, upstream)
    grads = {"x": x.grad}
    # Parameters of projections the case does not use get no gradient; leave them out.
    grads.update({n: p.grad for n, p in lora_params(model).items() if p.grad is not None})
    return [o.detach() for o in outs], grads


def qkv_stock(b, x):
    return (b.q_proj(x), b.k_proj(x), b.v_proj(x))


def qkv_fused(b, x):
    return lora_linears(x, [lora_parts(b.q_proj), lora_parts(b.k_proj), lora_parts(b.v_proj)])


def o_stock(b, x):
    return (b.o_proj(x),)


def o_fused(b, x):
    return lora_linears(x, [lora_parts(b.o_proj)])


def mlp_stock_for(kind):
    def act(g):
        if kind == "silu":
            return torch.nn.functional.silu(g)
        return torch.nn.functional.gelu(g, approximate="tanh" if kind == "gelu_tanh" else "none")

    return lambda b, x: (b.down_proj(act(b.gate_proj(x)) * b.up_proj(x)),)


def mlp_fused_for(kind, impl="torch"):
    act = GatedAct(kind, impl)
    return lambda b, x: (lora_mlp(x, lora_parts(b.gate_proj), lora_parts(b.up_proj), lora_parts(b.down_proj), act),)


CASES = {
    "qkv": (qkv_stock, qkv_fused, HIDDEN),
    "o": (o_stock, o_fused, HEADS_Q * HEAD_DIM),
    "mlp_silu": (mlp_stock_for("silu"), mlp_fused_for("silu"), HIDDEN),
    "mlp_gelu": (mlp_stock_for("gelu"), mlp_fused_for("gelu"), HIDDEN),
    "mlp_gelu_tanh": (mlp_stock_for("gelu_tanh"), mlp_fused_for("gelu_tanh"), HIDDEN),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def inputs_for(model, stock, in_dim, dtype, seed=1, shape=(2, 7)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, in_dim, generator=g).to(dtype)
    with torch.no_grad():
        outs = stock(inner(model), x)
    upstream = [torch.randn(o.shape, generator=g).to(dtype) for o in outs]
    return x, upstream


def rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def rel_close(a, ref, tol, name=""):
    """||a - ref|| <= tol * ||ref||: the whole tensor within fp32 rounding of the reference.

    A wrong gradient (a stale cached weight, a missing term) is off by O(1) relative; only the
    summation order differs between two right ones, and that stays near 1e-7 relative
    whatever BLAS the CPU has. Elementwise tolerances are not used here: single elements can
    be near zero after cancellation, where the rounding of the terms is all that is left."""
    assert a.shape == ref.shape and a.dtype == ref.dtype, (name, a.shape, ref.shape, a.dtype, ref.dtype)
    err = rel(a, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def assert_close_all(a_outs, a_grads, b_outs, b_grads, tol):
    """Every output and gradient within `tol` of the reference, relative to its norm."""
    assert len(a_outs) == len(b_outs)
    for i, (a, b) in enumerate(zip(a_outs, b_outs)):
        rel_close(a, b, tol, f"output {i}")
    assert a_grads.keys() == b_grads.keys()
    for k in a_grads:
        rel_close(a_grads[k], b_grads[k], tol, k)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_peft(case, bias):
    stock, fused, in_dim = CASES[case]
    model = make_block(ALL, bias=bias)
    x, up = inputs_for(model, stock, in_dim, torch.float32)
    ref = run(model, stock, x, up)
    got = run(model, fused, x, up)
    assert any(g.abs().max() > 0 for k, g in ref[1].items() if "lora_A" in k)
    assert_close_all(*got, *ref, 1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_rounding(case):
    """bf16 fused vs an fp64 run of the same weights: no worse than PEFT's own bf16 error."""
    stock, fused, in_dim = CASES[case]
    model16 = make_block(ALL, dtype=torch.bfloat16)
    model64 = copy.deepcopy(model16).double()
    x, up = inputs_for(model16, stock, in_dim, torch.bfloat16, shape=(3, 16))
    ref = run(model64, stock, x.double(), [u.double() for u in up])
    peft = run(model16, stock, x, up)
    got = run(model16, fused, x, up)
    for i in range(len(ref[0])):
        e_got, e_peft = rel(got[0][i], ref[0][i]), rel(peft[0][i], ref[0][i])
        assert e_got <= 2 * e_peft + 2e-3, (i, e_got, e_peft)
    for k in ref[1]:
        e_got, e_peft = rel(got[1][k], ref[1][k]), rel(peft[1][k], ref[1][k])
        assert e_got <= 2 * e_peft + 1e-2, (k, e_got, e_peft)
        assert got[1][k].dtype == peft[1][k].dtype


def test_fp32_adapters_on_bf16_base():
    """PEFT keeps fp32 adapters on a bf16 base (autocast_adapter_dtype); grads come back fp32."""
    model = make_block(ALL, dtype=torch.bfloat16)
    for n, p in lora_params(model).items():
        p.data = p.data.float()
    model64 = copy.deepcopy(model).double()
    stock, fused, in_dim = CASES["mlp_silu"]
    x, up = inputs_for(model, stock, in_dim, torch.bfloat16, shape=(2, 16))
    ref = run(model64, stock, x.double(), [u.double() for u in up])
    got = run(model, fused, x, up)
    assert got[0][0].dtype == torch.bfloat16
    for k in ref[1]:
        assert got[1][k].dtype == (torch.bfloat16 if k == "x" else torch.float32)
        assert rel(got[1][k], ref[1][k]) < 3e-2, k


def test_partial_targets_and_ranks():
    """Projections without LoRA run base-only inside the group; ranks may differ per module."""
    model = make_block(["q_proj", "v_proj", "up_proj"], bias=True, rank_pattern={"v_proj": 6})
    b = inner(model)
    assert type(b.k_proj) is nn.Linear and b.v_proj.lora_A["default"].weight.shape[0] == 6
    for case in ("qkv", "mlp_silu", "o"):
        stock, fused, in_dim = CASES[case]
        x, up = inputs_for(model, stock, in_dim, torch.float32)
        ref, got = run(model, stock, x, up), run(model, fused, x, up)
        assert_close_all(*got, *ref, 1e-5)


def test_input_without_grad_and_frozen_adapter():
    model = make_block(ALL)
    b = inner(model)
    b.q_proj.lora_A["default"].weight.requires_grad_(False)
    x = torch.randn(2, 5, HIDDEN)  # no grad: dx must not be computed (and not fail)
    q, k, v = qkv_fused(b, x)
    (q.sum() + k.square().sum() + v.sum()).backward()
    assert b.q_proj.lora_A["default"].weight.grad is None
    assert b.q_proj.lora_B["default"].weight.grad is not None
    assert b.k_proj.lora_A["default"].weight.grad is not None


def test_mlp_saves_no_activation_output():
    """The MLP Function keeps x, gate, up and rank-r products only (h is recomputed)."""
    model = make_block(ALL)
    b = inner(model)
    x = torch.randn(4, 9, HIDDEN, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp_fused_for("silu")(b, x)
    big = [s for s in saved if s == (36, INTER)]  # token-sized [N, intermediate] tensors
    assert len(big) == 2, saved  # gate and up; no act(gate) and no act(gate) * up


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_mlp_triton_activation_through_interpreter(kind):
    """The raw Triton activation launchers (in-place backward) inside LoRAMLP, on the CPU
    through Triton's interpreter when no GPU is present (conftest sets TRITON_INTERPRET=1)."""
    import engine.kernels.activations  # noqa: F401  (a broken module fails here, not skips)

    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = make_block(ALL)
    stock = mlp_stock_for(kind)
    x, up = inputs_for(model, stock, HIDDEN, torch.float32, shape=(1, 6))
    ref = run(model, stock, x, up)
    got = run(model, mlp_fused_for(kind, "triton"), x, up)
    assert_close_all(*got, *ref, 1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("targets", [ALL, ["gate_proj", "up_proj"]])
def test_mlp_in_row_slices_matches_whole(monkeypatch, impl, targets):
    """Above MLP_SLICE_BYTES the down projection and the activation run a slice of rows at a
    time (h and dh never whole): same outputs and gradients as the whole-tensor path, with and
    without LoRA on down, on the torch and the (interpreted) Triton activation."""
    import engine.fastpath.lora as la

    if impl == "triton" and not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    model = make_block(targets)
    stock = mlp_stock_for("silu")
    x, up = inputs_for(model, stock, HIDDEN, torch.float32, shape=(1, 600))
    whole = run(model, mlp_fused_for("silu", impl), x, up)
    # 600 rows x INTER fp32 in slices of 256 rows: three slices, the last one short
    monkeypatch.setattr(la, "MLP_SLICE_BYTES", 256 * INTER * 4)
    assert la._row_slices(600, INTER, 4) == [(0, 256), (256, 512), (512, 600)]
    sliced = run(model, mlp_fused_for("silu", impl), x, up)
    # dA_down is summed over 600 rows in another order: fp32 rounding only
    assert_close_all(*sliced, *whole, 1e-5)
    ref = run(model, stock, x, up)
    assert_close_all(*sliced, *ref, 1e-5)


# -- what keeps PEFT's path ------------------------------------------------------------------------


def test_unsupported_layers_report_reasons():
    b = inner(make_block(["q_proj"], lora_dropout=0.1))
    assert "dropout" in lora_unsupported_reason(b.q_proj)
    b = inner(make_block(["q_proj"], use_dora=True))
    assert "DoRA" in lora_unsupported_reason(b.q_proj)
    model = make_block(["q_proj"])
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"]))
    assert "adapters" in lora_unsupported_reason(inner(model).q_proj)
    model = make_block(["q_proj"])
    inner(model).q_proj.merge()
    assert "merged" in lora_unsupported_reason(inner(model).q_proj)
    assert "not a PEFT" in lora_unsupported_reason(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="dropout"):
        lora_parts(inner(make_block(["q_proj"], lora_dropout=0.1)).q_proj)
    assert lora_unsupported_reason(inner(make_block(["q_proj"])).q_proj) is None


def test_runtime_check_follows_adapter_state():
    model = make_block(ALL)
    b = inner(model)
    parts = [lora_parts(b.q_proj)]
    x = torch.randn(2, HIDDEN)
    assert runtime_ok(parts, x)
    assert not runtime_ok(parts, x.double())  # dtype differs from the base weight
    with model.disable_adapter():
        assert runtime_ok(parts, x)  # the reference pass stays on the fused path (the base alone)
    assert runtime_ok(parts, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not runtime_ok(parts, x)


# -- per-step cache of the low-precision adapter weights -------------------------------------------


def _fused_block_step(b, groups, x):
    """One forward/backward through fused QKV, O and MLP (planned groups)."""
    from engine.fastpath.lora_group import LoRAGroup  # noqa: F401  (groups are LoRAGroup objects)

    qkv, o, gate_up, down = groups
    q, k, v = lora_linears(x, qkv)
    (y,) = lora_linears(q, o)
    y = y + lora_mlp(x, gate_up, down, act=GatedAct("silu"))
    (y.float().square().sum() + k.float().sum() + v.float().sum()).backward()


def _plan_groups(b):
    from engine.fastpath.lora_group import LoRAGroup

    return (
        LoRAGroup([lora_parts(b.q_proj), lora_parts(b.k_proj), lora_parts(b.v_proj)]),
        LoRAGroup([lora_parts(b.o_proj)]),
        LoRAGroup([lora_parts(b.gate_proj), lora_parts(b.up_proj)]),
        LoRAGroup([lora_parts(b.down_proj)]),
    )


def test_cast_cache_follows_optimizer_steps():
    """fp32 adapters on a bf16 base: the bf16 copies are built once per weight update, the
    fp32 parameters get fp32 gradients, and after an optimizer step (or a `.data` swap) the
    new weights are used: the planned group matches an unplanned (uncached) call exactly."""
    model = make_block(ALL, dtype=torch.bfloat16)
    for p in lora_params(model).values():
        p.data = p.data.float()
    b = inner(model)
    qkv = _plan_groups(b)[0]
    opt = torch.optim.SGD(list(lora_params(model).values()), lr=0.5)
    x = torch.randn(2, 5, HIDDEN).to(torch.bfloat16)

    def fresh():
        return lora_linears(x, [lora_parts(b.q_proj), lora_parts(b.k_proj), lora_parts(b.v_proj)])

    first = lora_linears(x, qkv)
    cached = qkv.weights(qkv.ab(), torch.bfloat16)
    assert lora_linears(x, qkv)[0].equal(first[0])
    assert qkv.weights(qkv.ab(), torch.bfloat16) is cached  # no rebuild without an update
    for got, ref in zip(first, fresh()):
        assert got.equal(ref)

    sum(t.float().sum() for t in lora_linears(x.requires_grad_(), qkv)).backward()
    A = b.q_proj.lora_A["default"].weight
    assert A.grad is not None and A.grad.dtype == torch.float32
    opt.step()
    opt.zero_grad(set_to_none=True)
    after = lora_linears(x, qkv)
    assert not after[0].equal(first[0])  # the step changed the weights...
    for got, ref in zip(after, fresh()):
        assert got.equal(ref)  # ...and the cache serves the new ones
    assert qkv.weights(qkv.ab(), torch.bfloat16) is not cached

    # A `.data` swap does not bump _version; the data pointer catches it.
    with torch.no_grad():
        A.data = A.data * 2
    for got, ref in zip(lora_linears(x, qkv), fresh()):
        assert got.equal(ref)
    # Loading weights in place (copy_) bumps _version.
    with torch.no_grad():
        b.k_proj.lora_B["default"].weight.copy_(torch.randn_like(b.k_proj.lora_B["default"].weight))
    for got, ref in zip(lora_linears(x, qkv), fresh()):
        assert got.equal(ref)


def test_planned_groups_match_peft_gradients():
    """The cached path gives PEFT's outputs and gradients over three optimizer steps (fp32).

    Well-conditioned on purpose: a mean loss keeps every gradient O(1) (a summed square loss
    with lr 0.1 grew them to ~1e11 by the second step, where agreement is down to how each
    CPU rounds), and each step still moves the weights enough that a cache serving the
    previous step's weights would miss by far more than the tolerance (checked below)."""
    model = make_block(ALL)
    ref_model = copy.deepcopy(model)
    b, rb = inner(model), inner(ref_model)
    groups = _plan_groups(b)
    opt = torch.optim.SGD(list(lora_params(model).values()), lr=0.5)
    ref_opt = torch.optim.SGD(list(lora_params(ref_model).values()), lr=0.5)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))

    def loss(y, k, v):
        return y.float().square().mean() + k.float().mean() + v.float().mean()

    def fused():
        qkv, o, gate_up, down = groups
        q, k, v = lora_linears(x, qkv)
        (y,) = lora_linears(q, o)
        out = loss(y + lora_mlp(x, gate_up, down, act=GatedAct("silu")), k, v)
        out.backward()
        return out.detach()

    def stock():
        q, k, v = rb.q_proj(x), rb.k_proj(x), rb.v_proj(x)
        y = rb.o_proj(q) + rb.down_proj(torch.nn.functional.silu(rb.gate_proj(x)) * rb.up_proj(x))
        out = loss(y, k, v)
        out.backward()
        return out.detach()

    tol = 1e-5
    previous = None
    for step in range(3):
        got_loss, ref_loss = fused(), stock()
        rel_close(got_loss, ref_loss, tol, f"step {step}: loss")
        grads = {n: p.grad.clone() for n, p in lora_params(model).items()}
        ref_grads = {n: p.grad.clone() for n, p in lora_params(ref_model).items()}
        assert grads.keys() == ref_grads.keys() and len(grads) == 14
        for n in ref_grads:
            assert 1e-3 < ref_grads[n].norm() < 1e2, (step, n, ref_grads[n].norm())  # stays O(1)
            rel_close(grads[n], ref_grads[n], tol, f"step {step}: {n}")
        if previous is not None:  # the step changed every gradient well beyond the tolerance
            for n in ref_grads:
                assert rel(previous[n], ref_grads[n]) > 1000 * tol, (step, n)
        previous = ref_grads
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)


def test_warm_step_op_budget():
    """Host overhead guard: a warm fused fwd+bwd of one layer's projections (bf16 base, fp32
    adapters) casts no adapter weight (only the 14 dA/dB gradients go back to fp32) and stays
    within a generous aten-op budget (about 1.5x what it takes today); the uncached version
    cast 42 times (A and B in forward and backward, plus the gradients)."""
    from torch.profiler import ProfilerActivity, profile

    model = make_block(ALL, dtype=torch.bfloat16)
    for p in lora_params(model).values():
        p.data = p.data.float()
    b = inner(model)
    groups = _plan_groups(b)
    x = torch.randn(2, 8, HIDDEN).to(torch.bfloat16).requires_grad_()
    _fused_block_step(b, groups, x)  # builds the cache
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _fused_block_step(b, groups, x)
    inside = [e for e in prof.events() if e.name.startswith("aten::") and _under_lora(e)]
    casts = sum(e.name == "aten::_to_copy" for e in inside)
    assert casts <= 14, casts
    assert len(inside) <= OP_BUDGET, len(inside)


OP_BUDGET = 480  # 373 today; 578 before the cache and planned groups


def _under_lora(e):
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("LoRA"):
            return True
        p = p.cpu_parent
    return False
