"""The input embedding in host memory on the GPU, at Qwen3-8B's table (151,936 x 4,096 bf16,
1.16 GiB) on a 2-layer slice: moving it frees the table's memory, the step gives bit-identical
loss and LoRA gradients, and the training forward reads nothing back from the device (the ids
come from the batch's host copy). Run: pytest -m gpu tests/gpu/test_host_embed_gpu.py"""

from __future__ import annotations

import pytest
import torch

from bench.batches import make_batches
from bench.ours import prepare_ours
from bench.workloads import WORKLOADS, build_model, shrink
from engine.data.collate import PackedBatch
from engine.fastpath.host_embed import host_embedding, move_to_host
from tests.gpu_step import lora_grads, measured_step, randomize_lora_b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
GIB = 2**30


def test_host_table_frees_its_memory_and_gives_identical_steps():
    wl = shrink(WORKLOADS["W3"], 2)  # Qwen3-8B's layers and its full, untied vocabulary
    model = build_model(wl, dtype=torch.bfloat16, device=CUDA, attn_implementation="sdpa")
    prepared, _ = prepare_ours(model, wl, CUDA, {})
    model = prepared.model
    randomize_lora_b(model)
    b = make_batches(1, 8192, wl.config["vocab_size"])[0]
    batch = PackedBatch.from_documents(b.documents()).to(CUDA)
    measured_step(prepared, batch)  # compiles the kernels
    l0, _ = measured_step(prepared, batch)
    g0 = lora_grads(model)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(CUDA)
    report = move_to_host(model, CUDA)
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_allocated(CUDA)
    table = wl.config["vocab_size"] * wl.config["hidden_size"] * 2
    print(f"host embeddings: {report}; freed {freed / GIB:.3f} GiB of a {table / GIB:.3f} GiB table")
    assert report.startswith("on: ") and host_embedding(model) is not None
    assert freed >= 0.99 * table
    l1, _ = measured_step(prepared, batch, check_syncs=True)  # no device-to-host sync in the step
    g1 = lora_grads(model)
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def _qwen3_4b_slice():
    """Qwen3-4B's tied table (151,936 x 2,560 bf16, 0.72 GiB) and layer shape, 2 layers."""
    from bench.laptop import MODELS

    cfg = {k: v for k, v in MODELS["qwen3-4b"].items() if k != "model_type"}
    return WORKLOADS["W1"].with_changes(id="qwen3-4b-2L", config=dict(cfg, num_hidden_layers=2), tokens=2048)


def test_tied_table_on_the_host_frees_it_and_the_streamed_loss_matches():
    """W8's 4B case: the tied table leaves the device (both ends), the loss streams it in
    slices, and the step matches the device table's within bf16 rounding, with no sync."""
    wl = _qwen3_4b_slice()
    assert wl.config["tie_word_embeddings"]
    model = build_model(wl, dtype=torch.bfloat16, device=CUDA, attn_implementation="sdpa")
    prepared, _ = prepare_ours(model, wl, CUDA, {})
    model = prepared.model
    randomize_lora_b(model)
    b = make_batches(1, 2048, wl.config["vocab_size"])[0]
    batch = PackedBatch.from_documents(b.documents()).to(CUDA)
    measured_step(prepared, batch)
    l0, peak0 = measured_step(prepared, batch)
    g0 = lora_grads(model)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(CUDA)
    report = move_to_host(model, CUDA)
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_allocated(CUDA)
    table = wl.config["vocab_size"] * wl.config["hidden_size"] * 2
    assert report.startswith("on: ") and "tied head streams it" in report, report
    assert freed >= 0.99 * table, (freed, table)
    measured_step(prepared, batch)
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    l1, peak1 = measured_step(prepared, batch, check_syncs=True)
    t1.record()
    torch.cuda.synchronize()
    g1 = lora_grads(model)
    print(
        f"tied host table: {report}; freed {freed / GIB:.3f} GiB of {table / GIB:.3f}; step peak above weights "
        f"{peak0:.3f} -> {peak1:.3f} GiB; loss {l0.item():.5f} -> {l1.item():.5f}; step {t0.elapsed_time(t1):.1f} ms"
    )
    assert abs(l1.item() - l0.item()) <= 2e-3 * abs(l0.item())
    for n in g0:
        err = (g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-12)
        assert err <= 2e-2, (n, err.item())


def test_streamed_loss_against_the_fused_kernel_at_qwen3_4b_width():
    """The streamed loss from a pinned host table against the fused kernel's on the device
    table (both bf16 logits), and the copies' throughput."""
    from engine.fastpath.host_head import streamed_linear_cross_entropy
    from engine.kernels.fused_ce import fused_linear_cross_entropy_triton

    g = torch.Generator(device=CUDA).manual_seed(0)
    n, width, v = 2048, 2560, 151_936
    weight = (torch.randn(v, width, device=CUDA, generator=g) * 0.02).bfloat16()
    hidden = torch.randn(n, width, device=CUDA, generator=g).bfloat16()
    targets = torch.randint(0, v, (n,), device=CUDA, generator=g)
    targets[::7] = -100
    host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
    host.copy_(weight)
    h_ref = hidden.clone().requires_grad_(True)
    ref = fused_linear_cross_entropy_triton(h_ref, weight, targets)
    ref.backward()
    # No sync here: the reference's freed buffers are still in use by its queued kernels when
    # the streamed loss allocates its slice buffers (the copies must wait for them; a first
    # version did not, and corrupted the reference's gradient).
    h = hidden.clone().requires_grad_(True)
    streamed_linear_cross_entropy(h, host, targets).backward()  # warm-up
    h.grad = None
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = streamed_linear_cross_entropy(h, host, targets)
        got.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1)
    print(f"streamed CE at {n} x {width} x {v}: {ms:.1f} ms, {weight.numel() * 2 / ms / 1e6:.1f} GB/s of table")
    assert abs(got.item() - ref.item()) <= 1e-3 * abs(ref.item())
    err = (h.grad.float() - h_ref.grad.float()).norm() / h_ref.grad.float().norm()
    assert err <= 1e-2, err.item()
