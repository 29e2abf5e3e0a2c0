"""Offloaded checkpointing (engine.fastpath.offload) on the CPU: same loss and LoRA gradients as plain
checkpointing and as no checkpointing, on the fused path and on PEFT's (with dropout, where the
recompute must draw the same masks), plus the report and per-step stats. The streams and the
double-buffer overlap run on the GPU (tests/gpu/test_offload_gpu.py)."""

import pytest
import torch

from engine.config import FastPathConfig
from engine.data.collate import PackedBatch
from engine.train.step import forward_loss, prepare_model
from tests.engine.models.test_patches import tiny

LENGTHS = (7, 12, 5, 9)


def batch(seed=3, vocab=128):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    return PackedBatch.from_documents(docs)


def one_step(ckpt: bool, offload: str, fast: bool = True, lora=None, seed=0):
    model = tiny("qwen3", attn="sdpa", lora=lora, num_hidden_layers=3)
    fp = FastPathConfig() if fast else FastPathConfig(kernels=False, lora_autograd=False, fused_ce=False)
    prepared = prepare_model(model, fp, torch.device("cpu"), gradient_checkpointing=ckpt, offload=offload)
    model.train()
    b = batch()
    torch.manual_seed(seed)
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens, fused_ce=fast)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach(), grads, prepared.report, prepared


def assert_equal_steps(a, b, tol=1e-6):
    (l1, g1), (l0, g0) = a[:2], b[:2]
    assert abs(l1.item() - l0.item()) <= tol * abs(l0.item())
    assert g1.keys() == g0.keys()
    for n in g0:
        err = ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item()
        assert err <= tol, (n, err)


@pytest.mark.parametrize("mode", ["single", "double"])
def test_offload_gives_the_same_gradients(mode):
    plain = one_step(ckpt=False, offload="off")
    ckpt = one_step(ckpt=True, offload="off")
    off = one_step(ckpt=True, offload=mode)
    assert_equal_steps(off, ckpt)
    assert_equal_steps(off, plain, tol=1e-5)
    report, prepared = off[2], off[3]
    assert report["offload"].startswith(f"on: {mode} buffer, 3 layers"), report["offload"]
    stats = prepared.offloader.stats
    assert stats.layers == 3 and stats.mode == mode
    assert stats.bytes_offloaded == 3 * sum(LENGTHS) * 64 * 4  # 3 layer inputs, hidden 64, fp32


@pytest.mark.parametrize("offload", ["off", "double"])
def test_checkpointing_leaves_the_frozen_embedding_output_without_grad(monkeypatch, offload):
    # transformers' checkpointing hooks the embeddings so their output requires grad; with it the first
    # layer's backward made an input gradient nobody read and the embedding output was held through
    # the backward. The step unhooks it: the LoRA gradients stay those of the step without checkpointing.
    from engine.fastpath import offload as off_mod

    seen, needs_dx = [], []
    real = off_mod.OffloadedLayer.backward

    def backward(ctx, grad_out):
        needs_dx.append((ctx.index, ctx.needs_input_grad[4]))
        return real(ctx, grad_out)

    monkeypatch.setattr(off_mod.OffloadedLayer, "backward", staticmethod(backward))
    monkeypatch.setattr(
        torch.nn.Embedding,
        "forward",
        lambda self, x, _f=torch.nn.Embedding.forward: seen.append(_f(self, x)) or seen[-1],
    )
    plain = one_step(ckpt=False, offload="off")
    seen.clear()
    step = one_step(ckpt=True, offload=offload)
    assert seen and not seen[0].requires_grad
    assert_equal_steps(step, plain, tol=1e-5)
    if offload != "off":
        assert needs_dx == [(2, True), (1, True), (0, False)]


def test_offload_on_peft_path_with_dropout_recomputes_the_same_masks():
    lora = dict(lora_dropout=0.3)
    ckpt = one_step(ckpt=True, offload="off", fast=False, lora=lora, seed=5)
    off = one_step(ckpt=True, offload="double", fast=False, lora=lora, seed=5)
    assert_equal_steps(off, ckpt)
    # and the masks did matter: another seed gives other gradients
    other = one_step(ckpt=True, offload="double", fast=False, lora=lora, seed=6)
    with pytest.raises(AssertionError):
        assert_equal_steps(other, ckpt)


def test_offload_needs_checkpointing_and_says_so():
    _, _, report, prepared = one_step(ckpt=False, offload="double")
    assert report["offload"].startswith("off:") and "checkpointing is off" in report["offload"]
    assert prepared.offloader is None
    _, _, report, _ = one_step(ckpt=True, offload="off")
    assert report["offload"] == "off: disabled in config"


def test_no_grad_forward_in_train_mode_skips_the_offload():
    _, _, _, prepared = one_step(ckpt=True, offload="single")
    off = prepared.offloader
    off.stats.layers = 0
    b = batch(seed=9)
    with torch.no_grad():
        forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    assert off.stats.layers == 0


def test_session_reports_the_offload_mode_per_step(tmp_path):
    from engine.events import StepMetrics
    from tests.engine.train.test_session import run, tiny_config

    cfg = tiny_config(tmp_path, steps=2, offload="single", gradient_checkpointing=True)
    result, events = run(cfg)
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert steps and all(e.offload == "single" for e in steps)
    started = next(e for e in events if type(e).__name__ == "RunStarted")
    assert started.fast_paths["offload"].startswith("on: single buffer")


# -- keeping attention outputs for the recompute (long documents) -------------------------------

LONG = (150, 20)  # attention is ~0.28 of the tiny model's projection matmuls: above the threshold


def long_step(keep: bool, monkeypatch):
    from engine.fastpath import offload
    from engine.fastpath.attention import enable_packed_attention
    from engine.kernels import varlen_attention as va

    calls = []
    forward = va._forward

    def counting_forward(*args):
        calls.append(1)
        return forward(*args)

    monkeypatch.setattr(va, "_forward", counting_forward)
    backward, reused = va._backward, []

    def spying_backward(do, q, k, v, o, lse, L, o_private=False):
        out = backward(do, q, k, v, o, lse, L, o_private=o_private)
        reused.append(out[0].data_ptr() == o.data_ptr())  # dQ written into O's memory
        return out

    monkeypatch.setattr(va, "_backward", spying_backward)
    monkeypatch.setattr(offload, "ATTENTION_KEEP_MIN_SHARE", 0.25 if keep else float("inf"))
    model = tiny("qwen3", attn="sdpa", num_hidden_layers=3)
    prepared = prepare_model(
        model, FastPathConfig(), torch.device("cpu"), gradient_checkpointing=True, offload="single"
    )
    # The Triton kernel (interpreted here) is the backend that keeps its outputs.
    assert enable_packed_attention(model, backend="triton") == "on"
    model.train()
    g = torch.Generator().manual_seed(4)
    b = PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in LONG])
    loss = forward_loss(model, b, normalizer=b.num_trained_tokens, offloader=prepared.offloader)
    off = prepared.offloader
    kept_after_forward = [len(s.attention.outputs) for s in off.slots]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, len(calls), kept_after_forward, off, reused


@pytest.mark.slow  # two offloaded steps over long documents through the attention kernel (interpreted on a CPU)
def test_long_documents_keep_attention_outputs_for_the_recompute(monkeypatch):
    l1, g1, calls1, kept1, off1, reused1 = long_step(True, monkeypatch)
    reused1 = list(reused1)  # the second step's spy calls through the first one
    l0, g0, calls0, kept0, off0, reused0 = long_step(False, monkeypatch)
    # A kept output handed back, or one the recompute made, is the backward's alone: dQ goes into
    # its memory (one activation less at the layer backward's peak).
    assert reused1 == [True] * 3 and reused0 == [True] * 3
    assert off1.stats.attention_kept == "kept" and off0.stats.attention_kept == ""
    assert off1.stats.attention_layers == 3 and off1.stats.note() == "single, attention kept in 3 layers"
    assert off0.stats.attention_layers == 0 and off0.stats.note() == "single"
    assert kept1 == [1, 1, 1] and kept0 == [0, 0, 0]
    # the recompute took every kept output
    assert all(not s.attention.outputs and s.attention.mode is None for s in off1.slots)
    assert calls0 == 6 and calls1 == 3  # forward + recompute, against forward alone
    # The recompute's q/k/v are bitwise the first forward's: the same loss and gradients.
    assert torch.equal(l1, l0)
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)


def test_attention_keep_pays_only_for_long_documents():
    from bench.batches import doc_lengths
    from bench.workloads import get_workload, make_config
    from engine.fastpath.offload import attention_keep_bytes

    w6 = get_workload("W6")
    cfg = make_config(w6)
    # W6: one 32k document; 16 layers of o [32768, 32 x 64] bf16 plus an fp32 lse [32, 32768].
    assert attention_keep_bytes([32768], cfg, torch.bfloat16, 16) == 16 * (32768 * 2048 * 2 + 32 * 32768 * 4)
    # The same model on packed rows of ~256-token documents: attention is cheap, nothing kept.
    assert attention_keep_bytes(doc_lengths(0, 16384), cfg, torch.bfloat16, 16) == 0
    assert attention_keep_bytes([], cfg, torch.bfloat16, 16) == 0


def test_out_of_memory_with_kept_attention_reruns_the_step_without_keeping(tmp_path, monkeypatch):
    # A step that runs out of memory while attention outputs are kept is run again without
    # them (and without the failed attempt's partial gradients): the run ends as one that
    # never kept anything. The OOM is injected once, in the second micro-batch's forward, after
    # the first micro-batch's backward has added its LoRA gradients.
    from engine.events import StepMetrics
    from engine.fastpath import offload
    from engine.train import step as step_mod
    from tests.engine.train.test_session import run, tiny_config

    def losses(inject: bool):
        monkeypatch.setattr(offload, "ATTENTION_KEEP_MIN_SHARE", 0.0 if inject else float("inf"))
        real = step_mod.forward_loss
        calls = []

        def forward_loss(*args, **kw):
            loss = real(*args, **kw)
            calls.append(1)
            if inject and len(calls) == 2:
                raise torch.cuda.OutOfMemoryError("injected: out of memory")
            return loss

        monkeypatch.setattr(step_mod, "forward_loss", forward_loss)
        cfg = tiny_config(tmp_path / str(inject), steps=2, offload="single", gradient_checkpointing=True)
        result, events = run(cfg)
        steps = [e for e in events if isinstance(e, StepMetrics)]
        logs = [getattr(e, "message", "") for e in events]
        return [e.loss for e in steps], logs, len(calls)

    kept, logs, calls = losses(True)
    plain, _, plain_calls = losses(False)
    assert calls == plain_calls + 2  # two micro-batches of the failed attempt, then the step again
    assert any("no longer kept" in m for m in logs), logs
    assert kept == plain


# -- choosing double buffering from the last step's measured peak --------------------------------

MIB = 2**20


def test_double_buffering_is_chosen_from_the_last_measured_peak():
    from engine.fastpath.offload import DOUBLE_BUFFER_MARGIN, OffloadStats, second_buffer_short

    second = 512 * MIB
    # Nothing measured yet: free memory at the step's start decides.
    assert second_buffer_short(second, free=second + DOUBLE_BUFFER_MARGIN, allocated=0, measured=None) == ""
    assert "free VRAM" in second_buffer_short(second, free=second, allocated=0, measured=None)
    # 6 GiB allocated, 1.5 GiB free: a start-of-step look would say double. But the last
    # single-buffered step peaked at 7.2 GiB, and 7.2 + 0.5 + margin is over the 7.5 GiB ceiling.
    why = second_buffer_short(second, free=1536 * MIB, allocated=6144 * MIB, measured=(7373 * MIB, "single", second))
    assert why.startswith("the last step's peak 7373 MiB") and "of 7680 MiB" in why
    # The same peak from a double-buffered step already held its second buffer: double fits.
    assert second_buffer_short(second, 1536 * MIB, 6144 * MIB, (7373 * MIB, "double", second)) == ""
    # ... unless this step's buffer is larger than the measured one by more than the room left.
    assert second_buffer_short(2 * second, 1536 * MIB, 6144 * MIB, (7373 * MIB, "double", second))
    # The step's line says how many reloads the compute stream waited for (GPU only).
    stats = OffloadStats(mode="double", layers=28, copies=True)
    assert stats.note() == "double, 0 of 28 reloads waited"
    assert OffloadStats(mode="single", layers=28).note() == "single"  # a CPU: nothing travels


def test_long_single_buffered_rows_let_a_parked_input_go_at_the_next_layer():
    # (Its memory effect is measured on the GPU: tests/gpu/test_offload_gpu.py.)
    from types import SimpleNamespace

    from engine.fastpath.offload import EARLY_RELEASE_TOKENS, ActivationOffloader

    def early(mode, tokens):
        off = ActivationOffloader(mode, "cpu")
        off.install([SimpleNamespace(), SimpleNamespace()])
        off.begin_step(tokens, 64, torch.float32)
        return off._early_release

    assert early("single", EARLY_RELEASE_TOKENS)
    assert not early("single", EARLY_RELEASE_TOKENS - 1)  # a short row: the copy would show
    assert not early("double", EARLY_RELEASE_TOKENS)  # double keeps its inputs' timing


def test_an_output_outside_the_offloaders_recompute_is_left_alone(monkeypatch):
    # Plain checkpointing (no offloader): the recompute is torch's, the attention output may be held
    # by anyone, so dQ gets memory of its own.
    from engine.fastpath.attention import enable_packed_attention
    from engine.kernels import varlen_attention as va

    backward, reused = va._backward, []

    def spying_backward(do, q, k, v, o, lse, L, o_private=False):
        out = backward(do, q, k, v, o, lse, L, o_private=o_private)
        reused.append(out[0].data_ptr() == o.data_ptr())
        return out

    monkeypatch.setattr(va, "_backward", spying_backward)
    model = tiny("qwen3", attn="sdpa", num_hidden_layers=2)
    prepared = prepare_model(model, FastPathConfig(), torch.device("cpu"), gradient_checkpointing=True, offload="off")
    assert enable_packed_attention(model, backend="triton") == "on"
    model.train()
    b = batch()
    forward_loss(prepared, b, normalizer=b.num_trained_tokens).backward()
    assert reused == [False, False]


def test_a_layer_function_without_keyword_arguments_recomputes_without_the_attention_handle():
    from types import SimpleNamespace

    from engine.fastpath.offload import ActivationOffloader

    w = torch.randn(8, 8, requires_grad=True)
    off = ActivationOffloader("single", "cpu")
    off.install([SimpleNamespace(), SimpleNamespace()])
    off.begin_step(4, 8, torch.float32)
    h = torch.randn(4, 8)
    for i in range(2):
        h = off.checkpoint(i, lambda x: torch.tanh(x @ w), h)
    h.sum().backward()  # the recompute calls the plain function with no extra keyword
    assert w.grad is not None
