"""Tiled MLP (engine.fastpath.tiled_mlp) on the CPU, with tiles made small enough for a tiny
model: the same loss and LoRA gradients as the untiled MLP on the fused path and on PEFT's
(with LoRA dropout, where each tile's recompute must draw the same masks), inside offloaded
checkpointing too; and the session tiling the MLPs when a one-row step runs out of memory,
with a curve equal to the run that never ran short. Its memory is measured on the GPU
(bench --memcap, tests/gpu/test_tiled_mlp_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import FastPathConfig
from engine.data.collate import PackedBatch
from engine.events import MemoryAdjusted, StepMetrics
from engine.fastpath import tiled_mlp
from engine.fastpath.tiled_mlp import tile_of, tile_tokens
from engine.train.session import Faults
from engine.train.step import forward_loss, prepare_model, tile_mlps
from tests.engine.models.test_patches import tiny

CPU = torch.device("cpu")
TILE = 16


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled_mlp, "tile_tokens", lambda intermediate_size, dtype_bytes=2: TILE)


def step(tiled: bool, fast: bool = True, ckpt: bool = False, offload: str = "off", dropout: float = 0.0):
    model = tiny("qwen3", attn="sdpa", num_hidden_layers=2, lora={"lora_dropout": dropout})
    fp = FastPathConfig() if fast else FastPathConfig(kernels=False, lora_autograd=False, fused_ce=False)
    prepared = prepare_model(model, fp, CPU, gradient_checkpointing=ckpt, offload=offload)
    if tiled:
        assert tile_mlps(model, CPU) == f"on: tiles of {TILE} tokens in 2 layers"
    model.train()
    g = torch.Generator().manual_seed(2)
    b = PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in (21, 17, 12)])
    torch.manual_seed(0)
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens, fused_ce=fast)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a, b, tol=1e-5):
    (l1, g1), (l0, g0) = a, b
    assert abs(l1.item() - l0.item()) <= tol * abs(l0.item())
    assert g1.keys() == g0.keys()
    for n in g0:
        err = ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item()
        assert err <= tol, (n, err)


@pytest.mark.parametrize(
    "fast,ckpt,offload,dropout",
    [(True, False, "off", 0.0), (False, False, "off", 0.1), (True, True, "single", 0.0), (False, True, "double", 0.1)],
    ids=["fused", "peft-dropout", "fused-offload", "peft-dropout-offload"],
)
def test_tiled_mlp_gives_the_same_step(small_tiles, monkeypatch, fast, ckpt, offload, dropout):
    tiled = step(True, fast, ckpt, offload, dropout)
    if dropout:
        # Tiles draw their dropout masks tile by tile, a different (equally random) draw from
        # one mask over all tokens: the reference is the same tiles under plain autograd, which
        # the recompute must match mask for mask.
        def plain_tiles(inner, tile, anchor, x):
            out = torch.cat([inner(part) for part in x.reshape(-1, x.shape[-1]).split(tile)])
            return out.view(*x.shape[:-1], out.shape[-1])

        monkeypatch.setattr(tiled_mlp.TiledMLP, "apply", plain_tiles)
        reference = step(True, fast, ckpt, offload, dropout)
    else:
        reference = step(False, fast, ckpt, offload, dropout)
    assert_same(tiled, reference)


def test_tiles_are_sized_by_the_mlp_width():
    assert tile_tokens(14_336) == 2048  # Llama-3.1-8B: 4 x 14,336 x 2 bytes a token -> ~256 MiB a tile
    assert tile_tokens(12_288) == 2048  # Qwen3-8B
    assert tile_tokens(3_072) == 10_240
    assert tile_tokens(10**9) == 1024  # never under one unit


def test_out_of_memory_at_one_row_tiles_the_mlps_and_loses_nothing(tmp_path, small_tiles):
    from tests.engine.train.test_recovery import config, train

    def short_of_memory(attempt):  # from step 2 on, one row fits only with tiled MLPs
        return attempt["step"] >= 2 and not attempt["tiled_mlp"]

    _, straight, events0 = train(config(tmp_path / "a", rows=1), tmp_path / "a" / "run")
    session, result, events = train(
        config(tmp_path / "b", rows=1), tmp_path / "b" / "run", Faults(oom_when=short_of_memory)
    )
    changes = [(e.step, e.setting, e.before, e.after) for e in events if isinstance(e, MemoryAdjusted)]
    assert changes == [(2, "tiled_mlp", "off", "on")], changes
    message = next(e.message for e in events if isinstance(e, MemoryAdjusted))
    assert message.startswith(f"tiled MLP on: tiles of {TILE} tokens:"), message
    assert tile_of(session._model) == TILE
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5]
    curve = [e.loss for e in events if isinstance(e, StepMetrics)]
    assert curve == pytest.approx([e.loss for e in events0 if isinstance(e, StepMetrics)], rel=1e-4)
