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
