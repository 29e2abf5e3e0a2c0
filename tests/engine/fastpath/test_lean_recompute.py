"""Offload's lean recompute (engine.fastpath.recompute, fast_paths.lean_recompute) on the CPU: a
layer's recompute whose output only roots the backward skips the MLP's down projection and the
output, and the backward remakes the normed input, gate and up a row tile at a time
(engine.fastpath.lora.LoRAMLPUnread); the full recompute skips the down projection and the output
too (LoRAMLPTail), keeping gate and up. Same loss and gradients as the full recompute (several
tiles, a trainable norm weight too), fewer live bytes at the step's peak (counted from the
allocator's own events with torch.profiler, as the CPU allocator keeps no peak), and Gemma-2's
sandwich layer, whose MLP output goes through a norm, keeps the full recompute."""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import FastPathConfig
from engine.data.collate import PackedBatch
from engine.fastpath import lora as lora_mod
from engine.fastpath import tiled_mlp
from engine.models.patches import apply_fast_paths
from engine.train.step import forward_loss, prepare_model, tile_mlps
from tests.engine.models.test_patches import tiny

CPU = torch.device("cpu")
LAYERS = 2


@pytest.fixture
def unread_calls(monkeypatch):
    """How many times LoRAMLPUnread's backward ran (the real one, counted on the way through), and
    for each whether the residual's gradient came back in dy's memory (`calls.in_dy`)."""

    class Calls(list):
        in_dy: list

    calls = Calls()
    calls.in_dy = []
    real = lora_mod.LoRAMLPUnread.backward

    def counted(ctx, dy):
        calls.append(dy.shape)
        out = real(ctx, dy)
        calls.in_dy.append(out[0] is not None and out[0].data_ptr() == dy.data_ptr())
        return out

    monkeypatch.setattr(lora_mod.LoRAMLPUnread, "backward", staticmethod(counted))
    return calls


def _batch(vocab, lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return PackedBatch.from_documents([torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths])


def _step(model_type, lean, offload="single", train_norms=False, impl="auto", tiled=False, **shape):
    model = tiny(model_type, attn="eager" if model_type == "gemma2" else "sdpa", num_hidden_layers=LAYERS, **shape)
    if train_norms:  # a norm weight that trains gets its gradient through the tiles' autograd
        for name, p in model.named_parameters():
            if "post_attention_layernorm" in name:
                p.requires_grad_(True)
    fp = FastPathConfig(lean_recompute=lean)
    prepared = prepare_model(model, fp, CPU, gradient_checkpointing=True, offload=offload)
    if tiled:  # the MLPs over tiles of tokens (engine.fastpath.tiled_mlp), as a long row turns them on
        assert tile_mlps(model, CPU).startswith("on")
    if impl == "triton":  # every kernel through Triton (the interpreter): the in-place activation backward
        apply_fast_paths(model, fp, CPU, kernel_impl="triton")
    model.train()
    b = _batch(model.config.vocab_size, (37, 12, 64, 9, 50))
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach(), grads


def _assert_same(a, b, tol):
    assert abs(a[0].item() - b[0].item()) <= tol * abs(b[0].item())
    assert a[1].keys() == b[1].keys()
    for n in b[1]:
        err = ((a[1][n] - b[1][n]).norm() / b[1][n].norm().clamp_min(1e-30)).item()
        assert err <= tol, (n, err)


@pytest.mark.parametrize("offload", ["single", "double"])
def test_lean_recompute_gives_the_same_gradients_over_several_tiles(monkeypatch, unread_calls, offload):
    # 172 tokens, 64 wide: tiles of 64 rows, so 3 tiles per layer (the last one short).
    inter = tiny("qwen3").config.intermediate_size
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * inter * 4)
    lean = _step("qwen3", True, offload)
    assert len(unread_calls) == LAYERS
    assert unread_calls.in_dy == [True] * LAYERS  # the residual's gradient took dy's memory
    full = _step("qwen3", False, offload)
    assert len(unread_calls) == LAYERS  # the switch off: the full recompute
    _assert_same(lean, full, tol=1e-5)


@pytest.mark.parametrize(("offload", "train_norms"), [("double", True)])  # single: the lean tests' "full" runs
def test_every_offload_recompute_skips_the_down_projection_and_the_add(monkeypatch, offload, train_norms):
    # Not lean (W1, W2): the recompute still keeps gate and up, but its tail (LoRAMLPTail) makes
    # neither the down projection's output nor the layer's; same loss and gradients as checkpointing
    # without offload, whose recompute is the stock layer's.
    tails, downs = [], []
    real_backward, real_down = lora_mod.LoRAMLPTail.backward, lora_mod._down_forward

    def counted_backward(ctx, dy):
        tails.append(dy.shape)
        return real_backward(ctx, dy)

    def counted_down(*args):
        downs.append(args[0].shape)
        return real_down(*args)

    monkeypatch.setattr(lora_mod.LoRAMLPTail, "backward", staticmethod(counted_backward))
    monkeypatch.setattr(lora_mod, "_down_forward", counted_down)
    full = _step("qwen3", False, offload, train_norms=train_norms)
    assert len(tails) == LAYERS
    assert len(downs) == LAYERS  # the first forward's only: none in the recompute
    plain = _step("qwen3", False, "off", train_norms=train_norms)
    assert len(tails) == LAYERS and len(downs) == 3 * LAYERS  # checkpointing without offload: the stock tail
    if train_norms:
        assert any("post_attention_layernorm" in n for n in full[1])
    _assert_same(full, plain, tol=1e-5)
    monkeypatch.setenv("TUNESMITH_RECOMPUTE_TAIL", "0")  # bench's recompute_tail=false: the whole layer
    whole = _step("qwen3", False, offload, train_norms=train_norms)
    assert len(tails) == LAYERS and len(downs) == 5 * LAYERS
    _assert_same(whole, plain, tol=1e-5)


def _small_tiles(monkeypatch, inter):
    """Tiles of 64 rows for LoRAMLPUnread and of 32 tokens for the tiled MLP, on 172-token batches."""
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * inter * 4)
    monkeypatch.setattr(tiled_mlp, "TILE_UNIT", 32)
    monkeypatch.setattr(tiled_mlp, "TILE_BYTES", 32 * 4 * inter * 2)


def test_lean_recompute_stands_in_for_a_tiled_mlp(monkeypatch, unread_calls):
    # A long row turns the tiled MLP on (W7); LoRAMLPUnread tiles its own backward, so the lean
    # recompute skips the tiled MLP's forward and the layer's output there too. Same gradients as
    # the tiled MLP's full recompute and as the untiled layer.
    _small_tiles(monkeypatch, tiny("qwen3").config.intermediate_size)
    lean = _step("qwen3", True, tiled=True)
    assert len(unread_calls) == LAYERS
    full = _step("qwen3", False, tiled=True)
    plain = _step("qwen3", False)
    assert len(unread_calls) == LAYERS
    _assert_same(lean, full, tol=1e-5)
    _assert_same(full, plain, tol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU")
def test_lean_recompute_through_the_triton_kernels(monkeypatch, unread_calls):
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * tiny("qwen3").config.intermediate_size * 4)
    lean = _step("qwen3", True, impl="triton")
    full = _step("qwen3", False, impl="triton")
    assert len(unread_calls) == LAYERS
    _assert_same(lean, full, tol=1e-5)


def test_lean_recompute_with_a_trainable_norm_weight(monkeypatch, unread_calls):
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * tiny("qwen3").config.intermediate_size * 4)
    lean = _step("qwen3", True, train_norms=True)
    full = _step("qwen3", False, train_norms=True)
    assert len(unread_calls) == LAYERS
    assert any("post_attention_layernorm" in n for n in lean[1])
    _assert_same(lean, full, tol=1e-5)


def test_sandwich_layers_keep_the_full_recompute(unread_calls):
    # Gemma-2's MLP output goes through post_feedforward_layernorm, whose backward reads it.
    lean = _step("gemma2", True)
    full = _step("gemma2", False)
    assert unread_calls == []
    _assert_same(lean, full, tol=0.0)


def _peak_bytes(fn) -> int:
    """The highest sum of live bytes the CPU allocator reached while fn ran (its own events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_lean_recompute_has_fewer_live_bytes_at_the_peak(monkeypatch, unread_calls):
    # Wide enough that the MLP's [tokens, intermediate] tensors are the layer's largest (as on
    # W3), a small vocabulary so the loss's logits are not the step's peak.
    tokens, hidden, inter = 1024, 128, 384
    shape = dict(hidden_size=hidden, intermediate_size=inter, vocab_size=256)
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 128 * inter * 4)  # 8 tiles

    def measured(lean):
        model = tiny("qwen3", attn="sdpa", num_hidden_layers=LAYERS, **shape)
        prepared = prepare_model(model, FastPathConfig(lean_recompute=lean), CPU, True, offload="single")
        model.train()
        b = _batch(256, (128,) * (tokens // 128))

        def step():
            forward_loss(prepared, b, normalizer=b.num_trained_tokens).backward()

        step()  # the first step makes the host buffers and the gradients' storage
        for p in model.parameters():
            p.grad = None
        return _peak_bytes(step)

    full, lean = measured(False), measured(True)
    assert len(unread_calls) == 2 * LAYERS
    gate_up = 2 * tokens * inter * 4
    # Gate and up are no longer kept from the recompute to the backward (one tile of them is).
    assert lean <= full - gate_up, (full, lean, gate_up)


def test_a_saved_tensor_is_remade_for_the_backward_not_kept():
    from engine.fastpath.recompute import remade_when_unpacked

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(5, 8, generator=g, requires_grad=True)
    remakes = []

    def normed(t):
        return torch.nn.functional.rms_norm(t, (8,))

    def remake():
        remakes.append(1)
        return normed(x.detach())

    def loss(remade: bool):
        h = normed(x)
        with remade_when_unpacked(h, remake, on=remade):
            y = torch.nn.functional.linear(h.view(3, 2, 8), w)  # linear saves a view of h for dw
        return (y * y).sum()

    expect = torch.autograd.grad(loss(False), (x, w))
    assert remakes == []
    got = torch.autograd.grad(loss(True), (x, w))
    assert remakes == [1]  # linear's backward read h through the remade copy
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_forward_without_autograd_runs_the_mlp_in_row_tiles(monkeypatch):
    # Offload's first forward, reference passes, eval: one tile's gate/up at a time, same logits.
    model = tiny("qwen3", attn="sdpa", num_hidden_layers=LAYERS)
    prepare_model(model, FastPathConfig(), CPU, gradient_checkpointing=False)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 172), generator=torch.Generator().manual_seed(5))
    calls = []
    real = lora_mod._mlp_no_grad
    monkeypatch.setattr(lora_mod, "_mlp_no_grad", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        assert calls == []  # 172 rows fit one tile: LoRAMLP itself
        monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * model.config.intermediate_size * 4)
        tiled = model(input_ids=ids).logits
        assert len(calls) == LAYERS
        with model.disable_adapter():  # the reference pass: the base alone, tiled the same way
            base = model(input_ids=ids).logits
            monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 2**40)
            base_whole = model(input_ids=ids).logits
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base, base_whole, rtol=1e-5, atol=1e-5)
    assert (base - tiled).abs().max() > 1e-3  # the adapters were on in the first pair


def test_a_backward_that_fails_leaves_no_recompute_allocated(monkeypatch):
    # An out-of-memory error in a layer's backward, before the backward reached its attention: the
    # layer's recompute (its input, q/k/v, the attention's saved tensors) must go with the failed
    # step, or the session's retry starts with 5-6 GiB less (W7's rows on the H200). The saved-tensor
    # hook of the lean recompute once tied each output to its own node in a cycle Python cannot see.
    import gc
    import traceback
    from collections import Counter

    model = tiny("qwen3", attn="sdpa", num_hidden_layers=3)
    prepared = prepare_model(model, FastPathConfig(lean_recompute=True), CPU, True, offload="single")
    model.train()
    b = _batch(model.config.vocab_size, (200, 300))
    hidden = model.config.hidden_size

    def live() -> Counter:  # tensors at least a quarter of a layer input, by shape
        gc.collect()
        return Counter(
            (tuple(o.shape), o.dtype)
            for o in gc.get_objects()
            if type(o) is torch.Tensor and o.numel() >= 500 * hidden // 4
        )

    def step():
        forward_loss(prepared, b, normalizer=b.num_trained_tokens).backward()

    step()
    for p in model.parameters():
        p.grad = None
    before = live()
    real, calls = lora_mod.LoRAMLPUnread.backward, []

    def failing(ctx, dy):
        calls.append(1)
        if len(calls) == 2:  # the second layer's backward, at its start
            raise torch.OutOfMemoryError("injected out of memory")
        return real(ctx, dy)

    monkeypatch.setattr(lora_mod.LoRAMLPUnread, "backward", staticmethod(failing))
    with pytest.raises(torch.OutOfMemoryError) as failed:
        step()
    traceback.clear_frames(failed.value.__traceback__)
    failed = None
    for p in model.parameters():
        p.grad = None
    assert live() == before


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
def test_the_normed_attention_input_is_freed_once_q_k_v_are_made(monkeypatch, lean):
    # W7's highest point was the recompute's attention, holding the normed input (an activation of
    # the row) that only q/k/v read. In the lean recompute its memory goes before the attention runs;
    # elsewhere (the first forward, the full recompute) it stays until the layer returns.
    from engine.fastpath import recompute
    from engine.models import patches

    normed, seen = [], []
    real = patches._attention_interface

    def interface(impl, eager):
        attention = real(impl, eager)

        def watched(*args, **kwargs):
            seen.append((recompute.lean(), normed[-1].untyped_storage().nbytes()))
            return attention(*args, **kwargs)

        return watched

    monkeypatch.setattr(patches, "_attention_interface", interface)
    model = tiny("qwen3", attn="sdpa", num_hidden_layers=LAYERS)
    for layer in model.base_model.model.model.layers:
        layer.input_layernorm.register_forward_hook(lambda m, args, out: normed.append(out))
    prepared = prepare_model(model, FastPathConfig(lean_recompute=lean), CPU, True, offload="single")
    model.train()
    b = _batch(model.config.vocab_size, (37, 12, 64))
    forward_loss(prepared, b, normalizer=b.num_trained_tokens).backward()
    recomputed = [nbytes for lean_call, nbytes in seen if lean_call]
    kept = [nbytes for lean_call, nbytes in seen if not lean_call]
    whole = b.input_ids.numel() * model.config.hidden_size * 4
    assert len(kept) == (1 if lean else 2) * LAYERS and all(n == whole for n in kept)  # the full recompute's too
    assert len(recomputed) == (LAYERS if lean else 0)
    assert all(n == 0 for n in recomputed)


def test_only_the_blocks_own_whole_tensor_is_released():
    from engine.fastpath.recompute import release_remade, remade_when_unpacked

    whole = torch.randn(4, 8)
    with remade_when_unpacked(whole, whole.clone, True, releasable=False):
        assert not release_remade(whole)  # the caller did not say it may go
    with remade_when_unpacked(whole, whole.clone, True, releasable=True):
        assert not release_remade(torch.randn(4, 8))  # not the block's tensor
        assert release_remade(whole)
        assert not release_remade(whole)  # once
    assert whole.untyped_storage().nbytes() == 0
    shared = torch.randn(8, 8)
    part = shared[:4]  # a view into memory another tensor's rows share
    with remade_when_unpacked(part, part.clone, True, releasable=True):
        assert not release_remade(part)
    assert shared.untyped_storage().nbytes() == 8 * 8 * 4
    assert not release_remade(shared)  # outside any block


def _qlora_step(lean, dequantized=None):
    """One step of a tiny NF4 (QLoRA) Qwen3 under single offload, fp32 compute; `dequantized`
    collects the MLP bases dequantized during the backward."""
    pytest.importorskip("bitsandbytes")
    from engine.fastpath import quant
    from tests.engine.fastpath.test_qlora import qlora_model

    model = qlora_model()
    fast = FastPathConfig(lean_recompute=lean)
    prepared = prepare_model(model, fast, CPU, gradient_checkpointing=True, offload="single")
    model.train()
    b = _batch(model.config.vocab_size, (37, 12, 64, 9, 50))
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    if dequantized is not None:
        mlp_bases = {
            id(getattr(layer.mlp, name).base_layer): name
            for layer in model.get_base_model().get_decoder().layers
            for name in ("gate_proj", "up_proj", "down_proj")
        }
        real = quant.dequantize

        def counted(layer, dtype):
            if id(layer) in mlp_bases:
                dequantized.append(id(layer))
            return real(layer, dtype)

        quant.dequantize = counted
    try:
        loss.backward()
    finally:
        if dequantized is not None:
            quant.dequantize = real
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def test_a_4bit_base_takes_the_lean_recompute_and_is_dequantized_once_for_all_tiles(monkeypatch, unread_calls):
    # QLoRA under offload: the recompute skips the MLP as for 16-bit bases, and the backward's row
    # tiles (3 of 64 rows here) share one dense copy of each MLP weight instead of decoding per tile.
    from bench.workloads import CPU_TINY

    inter = CPU_TINY.config["intermediate_size"]
    monkeypatch.setattr(lora_mod, "UNREAD_TILE_BYTES", 64 * inter * 4)
    seen = []
    lean = _qlora_step(True, seen)
    assert len(unread_calls) == LAYERS
    assert len(seen) == 3 * LAYERS and len(set(seen)) == 3 * LAYERS  # each MLP weight once
    full = _qlora_step(False)
    assert len(unread_calls) == LAYERS  # the switch off: LoRAMLP's full recompute
    _assert_same(lean, full, tol=1e-5)
