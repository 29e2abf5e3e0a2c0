"""Tiled MLP on the GPU at W7's shape (Llama-3.1-8B layers, one 32k-token document, bf16,
offloaded checkpointing): the step's loss and LoRA gradients match the untiled MLP's to bf16
rounding, with no device-to-host sync, and the step's peak memory falls by most of the MLP's
intermediates. Run: pytest -m gpu tests/gpu/test_tiled_mlp_gpu.py"""

from __future__ import annotations

import pytest
import torch

from bench.batches import make_batches
from bench.ours import prepare_ours
from bench.workloads import WORKLOADS, build_model, shrink
from engine.data.collate import PackedBatch
from tests.gpu_step import lora_grads, measured_step, randomize_lora_b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
TOKENS = 32_768


def run(tiled: bool):
    wl = shrink(WORKLOADS["W7"].with_changes(quant=None), 2, vocab=32_000)
    model = build_model(wl, dtype=torch.bfloat16, device=CUDA, attn_implementation="sdpa")
    prepared, _ = prepare_ours(model, wl, CUDA, {"offload": "single", "tiled_mlp": tiled})
    model = prepared.model
    randomize_lora_b(model)
    b = make_batches(1, TOKENS, wl.config["vocab_size"], packing="single")[0]
    batch = PackedBatch.from_documents(b.documents()).to(CUDA)
    measured_step(prepared, batch)  # warm-up (compiles), then the measured step, checked for syncs
    loss, peak = measured_step(prepared, batch, check_syncs=True)
    grads = lora_grads(model)
    report = prepared.report["tiled_mlp"]
    del model, prepared
    torch.cuda.empty_cache()
    return loss.item(), grads, peak, report, wl.config["intermediate_size"]


def test_tiled_mlp_matches_and_needs_less_memory():
    l0, g0, p0, r0, inter = run(False)
    l1, g1, p1, r1, _ = run(True)
    assert r0.startswith("off") and r1.startswith("on: tiles of 2,048 tokens"), (r0, r1)
    rel = max(((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item() for n in g0)
    print(
        f"tiled MLP at {TOKENS} tokens: peak {p1:.2f} GiB vs {p0:.2f} GiB untiled; loss {l1:.5f} vs {l0:.5f}; "
        f"worst LoRA grad rel err {rel:.2e}"
    )
    assert l1 == pytest.approx(l0, rel=1e-3)
    assert rel < 1e-2
    # Untiled, a layer's recompute and backward hold gate, up and their product for every token
    # (14,336 x 2 bytes a token each, 0.875 GiB apiece at 32k); tiled, one 2,048-token tile's.
    # At least half of two of them must be gone.
    assert p0 - p1 >= 0.5 * 2 * inter * 2 * TOKENS / 2**30
