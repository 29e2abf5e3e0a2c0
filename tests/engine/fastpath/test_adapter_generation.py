"""The adapter generation belongs to the model (issue 29 item 4): engine.fastpath.lora_group.

The fused LoRA path caches its groups' adapter weights (cast, stacked, scaled) and rebuilds them
when the model's `AdapterClock` advances, which only the optimizer made for that model does
(engine.train.optim.make_optimizer: after each step and each load of its state). Counted through
the run's own counters (`lora_cache_builds`):

- two models trained in one process never make each other's caches rebuild (a process-wide
  number did: every step of one made every group of the other rebuild);
- an optimizer made elsewhere (a torch AdamW) advances nothing; the engine's does;
- a rollback to a snapshot and a resume from a checkpoint are seen by the fused path: the loss
  after the restore is the loss of the restored weights, and the restore advanced the clock
  (FSDP's gather of the restored shards keeps the weights' `_version`, so there only the clock
  tells the cache).

The fused AdamW (kind "adamw_fused", which runs on a CPU too) is used throughout: it leaves the
weights' `_version` alone, so the generation is the only thing that can tell the cache. The
checks take a device: tests/gpu/test_adapter_generation_gpu.py runs them on CUDA (Triton kernels).
"""

from __future__ import annotations

import threading

import torch

from engine.config import FastPathConfig, LoraConfig, TrainingConfig
from engine.counters import Counters
from engine.data.collate import PackedBatch
from engine.fastpath.lora_group import adapter_clock
from engine.models.lora import attach_lora, lora_parameters
from engine.train.checkpoint import load_checkpoint, save_checkpoint
from engine.train.optim import make_optimizer
from engine.train.rollback import LossGuard
from engine.train.step import forward_loss, prepare_model
from tests.tiny_models import tiny_model as build_tiny

CPU = torch.device("cpu")
ON = FastPathConfig(kernels=True, lora_autograd=True, fused_ce=True, packed_attention=True)
LAYERS = 2
GROUPS = 4 * LAYERS  # q/k/v, o, gate/up and down in every decoder layer


def tiny_model(seed: int = 0, device: torch.device = CPU):
    model = build_tiny("llama", seed=seed, num_hidden_layers=LAYERS).to(device)
    model = attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))
    report = prepare_model(model, ON, device, gradient_checkpointing=True).report
    assert report["lora_qkv"] == "on" and report["lora_o"] == "on" and report["lora_mlp"] == "on", report
    return model


def batch(seed: int, device: torch.device) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 6, 13)]
    return PackedBatch.from_documents(docs).to(device)


def loss_of(model, seed: int = 1) -> float:
    b = batch(seed, model.device)
    with torch.no_grad():
        return float(forward_loss(model, b, b.num_trained_tokens))


def train_step(model, opt, seed: int = 1) -> None:
    b = batch(seed, model.device)
    forward_loss(model, b, b.num_trained_tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def builds(run: Counters) -> int:
    """Cache rebuilds counted for `run` since the last call."""
    return run.reset().get("lora_cache_builds", 0)


def test_two_models_trained_in_one_process_keep_their_caches():
    check_two_models(CPU)


def test_a_rollback_and_a_resume_are_seen_by_the_fused_path(tmp_path):
    check_rollback_and_resume(CPU, tmp_path)


def check_two_models(device: torch.device) -> None:
    """Model A trains while model B's caches hold B's weights: B's next forwards rebuild nothing,
    on its own thread or another; A's own step makes each of A's groups rebuild once."""
    a, b = tiny_model(0, device), tiny_model(1, device)
    opt_a = make_optimizer(a, lr=0.05, kind="adamw_fused")
    opt_b = make_optimizer(b, lr=0.05, kind="adamw_fused")
    run_a, run_b = Counters(), Counters()
    with run_b.active():
        train_step(b, opt_b)
        loss_of(b)  # B's caches hold B's weights after its step
        builds(run_b)
    with run_a.active():
        for seed in (1, 2):
            train_step(a, opt_a, seed)
        assert builds(run_a) == 2 * GROUPS  # each step's forward rebuilt every group once
        loss_of(a)
        assert builds(run_a) == GROUPS  # A's last step made A's caches stale
    with run_b.active():
        loss_of(b)
        assert builds(run_b) == 0, "model A's steps made model B's cached adapter weights stale"

    seen = []

    def probe():  # a paused run's probe, say: another thread reading B with B's run active
        with run_b.active():
            seen.append(loss_of(b))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen and builds(run_b) == 0
    with run_b.active():
        train_step(b, opt_b)  # its forward reads the caches as they were
        assert builds(run_b) == 0
        loss_of(b)
        assert builds(run_b) == GROUPS  # B's own step made B's caches stale
    assert builds(run_a) == 0


def test_only_the_optimizer_made_for_the_model_advances_its_generation():
    model = tiny_model()
    clock = adapter_clock(model)
    params = lora_parameters(model)
    theirs = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    generation = clock.generation
    theirs.step()
    assert any(not torch.equal(p.detach(), q) for p, q in zip(params, before))
    assert clock.generation == generation

    ours = make_optimizer(model, lr=0.1, kind="adamw_fused")
    assert adapter_clock(model) is clock  # one clock per model, whoever asks
    ours.step()
    assert clock.generation == generation + 1
    ours.load_state_dict(ours.state_dict())  # a resume or a rollback loads the state with the weights
    assert clock.generation == generation + 2
    other = tiny_model()
    make_optimizer(other, lr=0.1, kind="adamw_fused").step()
    assert clock.generation == generation + 2 and adapter_clock(other) is not clock


def test_the_fused_cache_follows_the_engine_optimizers_steps_and_no_other():
    """After the engine optimizer's fused steps the fast path's loss is the loss with every cache
    rebuilt by force; after an optimizer made elsewhere the cache serves the weights of before its
    step (what a missing hook would do), which the forced rebuild shows."""
    for engine in (True, False):
        model = tiny_model()
        opt = (
            make_optimizer(model, lr=0.05, kind="adamw_fused")
            if engine
            else torch.optim.AdamW(lora_parameters(model), lr=0.05, fused=True)
        )
        for seed in (1, 2):  # the second step moves lora_B off zero, so every adapter term counts
            loss_of(model)  # the cache holds this step's weights
            train_step(model, opt, seed)
        served = loss_of(model)
        adapter_clock(model).advance()  # force every cache to rebuild from the weights as they are
        fresh = loss_of(model)
        if engine:
            assert served == fresh
        else:
            assert abs(served - fresh) > 1e-6, (served, fresh)


def check_rollback_and_resume(device: torch.device, tmp_path) -> None:
    """Snapshot (and checkpoint) at step 2, train on with the caches rebuilt at the new weights,
    then go back: the fast path's loss is step 2's again, and each restore advanced the clock."""
    model = tiny_model(0, device)
    opt = make_optimizer(model, lr=0.05, kind="adamw_fused")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    clock = adapter_clock(model)
    for seed in (1, 2):
        train_step(model, opt, seed)
    guard = LossGuard(
        lora_parameters(model), opt, scheduler, TrainingConfig(), device, False, lambda e: None, lambda m: None
    )
    snap = guard.take_snapshot(2)
    ckpt = save_checkpoint(tmp_path / "step-2", model, opt, scheduler, 2, {})
    at_two = loss_of(model)

    def train_on():
        for seed in (3, 4):
            train_step(model, opt, seed)
        moved = loss_of(model)  # the caches hold step 4's weights
        assert abs(moved - at_two) > 1e-4, (moved, at_two)

    train_on()
    generation = clock.generation
    guard.load_snapshot(snap)
    assert clock.generation > generation
    assert abs(loss_of(model) - at_two) < 1e-6, "the fused path served the weights of before the restore"

    train_on()
    generation = clock.generation
    load_checkpoint(ckpt, model, opt, scheduler)
    assert clock.generation > generation
    assert abs(loss_of(model) - at_two) < 1e-6, "the fused path served the weights of before the restore"
