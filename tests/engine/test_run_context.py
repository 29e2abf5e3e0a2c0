"""State that belongs to a run, not to the process (issue 29 item 4).

- the fast-path counters: each run counts into its own `Counters` (engine.counters), so two runs
  in one process never see each other's counts, and a backward on another thread counts for the
  run that started it;
- the adapter generation that invalidates the fused LoRA path's cached adapter weights belongs to
  the model: tests/engine/fastpath/test_adapter_generation.py;
- importing the engine leaves the environment alone: the CUDA allocator's setting is made by the
  entry points (engine.allocator).
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine import counters
from engine.config import FastPathConfig, LoraConfig
from engine.counters import Counters, count, current, reset_counters
from engine.data.collate import PackedBatch
from engine.models.lora import attach_lora
from engine.train.step import forward_loss, prepare_model
from tests.tiny_models import tiny_model as build_tiny

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
ON = FastPathConfig(kernels=True, lora_autograd=True, fused_ce=True, packed_attention=True)


def tiny_model():
    model = build_tiny("llama")
    model = attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))
    report = prepare_model(model, ON, CPU, gradient_checkpointing=True).report
    assert report["lora_qkv"] == "on" and report["lora_mlp"] == "on", report
    return model


def batch(seed: int = 1) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    return PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 6, 13)])


def micro_step(model, seed: int = 1) -> None:
    """One micro-batch: packed metadata built, forward through the fast paths, backward (with the
    checkpointed layers' recompute)."""
    b = batch(seed)
    forward_loss(model, b, b.num_trained_tokens).backward()


# -- counters: one per run ----------------------------------------------------------------------


def test_two_runs_in_one_process_count_apart():
    """Two threads, each with its run's Counters active, train at the same time: each run's
    counts are its own micro-steps' (one vs two), and nothing lands outside them."""
    with Counters().active() as alone:  # what one micro-step counts, measured on its own
        micro_step(tiny_model())
    one = {k: v for k, v in alone.reset().items() if v}
    assert one["metadata_builds"] == 1 and one["lora_linears"] > 0 and one["lora_mlp"] > 0, one

    models = [tiny_model(), tiny_model()]
    runs = [Counters(), Counters()]
    unowned_before = dict(counters.UNOWNED)
    both_active = threading.Barrier(2)
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            with runs[i].active():
                both_active.wait(timeout=60)  # both runs active before either counts
                for _ in range(i + 1):
                    micro_step(models[i])
                both_active.wait(timeout=60)  # and still both active until both are done
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {k: v for k, v in runs[0].reset().items() if v} == one
    # Twice the calls; the cached adapter weights are built once, as no optimizer step came between.
    twice = {k: v if k == "lora_cache_builds" else 2 * v for k, v in one.items()}
    assert {k: v for k, v in runs[1].reset().items() if v} == twice
    assert dict(counters.UNOWNED) == unowned_before


def test_a_thread_without_a_run_counts_for_the_only_run_or_for_none():
    """A thread the engine did not start (a probe, a library call): its counts go to the one run
    active in the process, and to no run (UNOWNED) when two are active."""
    first, second = Counters(), Counters()
    seen: dict[str, Counters] = {}

    def elsewhere(name: str) -> None:
        seen[name] = current()
        count("host_syncs")

    with first.active():
        t = threading.Thread(target=elsewhere, args=("one run",))
        t.start()
        t.join()
        ready, done = threading.Event(), threading.Event()

        def other_run() -> None:
            with second.active():
                ready.set()
                done.wait(timeout=60)

        other = threading.Thread(target=other_run)
        other.start()
        assert ready.wait(timeout=60)
        t = threading.Thread(target=elsewhere, args=("two runs",))
        t.start()
        t.join()
        done.set()
        other.join()
        assert current() is first  # this thread's own run, whatever else is active
    assert seen["one run"] is first and first["host_syncs"] == 1
    assert seen["two runs"] is counters.UNOWNED and second["host_syncs"] == 0
    assert current() is counters.UNOWNED  # no run active any more


def test_a_backward_counts_for_the_run_that_started_it():
    """On CUDA the autograd engine runs backward nodes on its own thread, where no ContextVar is
    set; torch stashes the launching thread's context for it, and the counters read their run from
    there. On the CPU backward runs on the launching thread, so this checks the two halves: a
    backward started under a run stashes a context holding that run, and a thread with no run of
    its own, holding that stash, counts into it even while another run is active."""
    if not hasattr(torch._C, "_get_obj_in_tls"):
        pytest.skip("this torch stashes no context for its autograd threads")

    stashed = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            stashed["context"] = torch._C._get_obj_in_tls("context") if torch._C._is_key_in_tls("context") else None
            return g * 2

    run, other = Counters(), Counters()
    with run.active():
        Probe.apply(torch.ones(3, requires_grad=True)).sum().backward()
    launched = stashed["context"]
    assert isinstance(launched, contextvars.Context) and launched.get(counters._CURRENT) is run

    def autograd_worker() -> None:
        torch._C._stash_obj_in_tls("context", launched)  # what the engine's thread holds in backward
        try:
            count("nf4_dequant:torch")
        finally:
            torch._C._remove_obj_from_tls("context")
        count("nf4_dequant:torch")  # after the backward: no run of its own; `other` is the only one

    with other.active():
        t = threading.Thread(target=autograd_worker)
        t.start()
        t.join()
    assert run["nf4_dequant:torch"] == 1 and other["nf4_dequant:torch"] == 1


def test_a_generation_phase_leaves_the_step_counts_as_they_were():
    """Counts made inside `set_aside` (GRPO's generation phase) are dropped; the step's stay."""
    run = Counters()
    with run.active():
        count("lora_mlp")
        with run.set_aside():
            count("lora_mlp")
            count_fallback = counters.count_fallback
            count_fallback("attention", "KV cache")
        assert reset_counters() == {"metadata_builds": 0, "host_syncs": 0, "moe_calls": 0, "lora_mlp": 1}


# -- the environment: entry points set the allocator, imports do not ------------------------------


def _python(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_importing_the_engine_changes_no_environment_variable():
    code = (
        "import os; before = dict(os.environ)\n"
        "import engine, engine.api, engine.train.session, engine.train.step, engine.fastpath.lora_group\n"
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        "print(changed)"
    )
    assert _python(code, _clean_env()) == "[]"


@pytest.mark.skipif(sys.platform != "linux", reason="expandable segments are asked for on Linux only")
def test_the_cli_entry_point_asks_for_expandable_segments_and_a_persons_setting_wins():
    code = (
        "import os\nfrom engine.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    )
    assert _python(code, _clean_env()) == "expandable_segments:True"
    assert _python(code, {**_clean_env(), "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == "max_split_size_mb:64"


# -- two sessions at once ------------------------------------------------------------------------


def _session_counts(tmp_path, name: str, setup: threading.Lock | None = None, start=None) -> list[tuple]:
    """Per step: (step, fast_path_calls, fallbacks, metadata_builds, host_syncs) of a tiny demo
    run with the fast paths forced on (the CPU runs their torch references). `setup`: held while
    the model loads (transformers' loading is not safe on two threads at once); `start`: a
    Barrier the run waits at, set up, before its first step."""
    from engine.config import RunConfig
    from engine.events import Failed, RunStarted, StepMetrics
    from engine.resources import DEMO_PRESET
    from engine.train.session import TrainingSession

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.data.max_examples = 24
    cfg.data.max_seq_len = 128
    cfg.training.max_steps = 3
    cfg.training.rows_per_micro_batch = 1
    cfg.training.grad_accum = 2
    cfg.training.save_every = 0
    cfg.training.log_every = 1
    for path in ("kernels", "lora_autograd", "fused_ce", "packed_attention"):
        setattr(cfg.fast_paths, path, True)
    cfg.output.dir = str(tmp_path)
    events, held = [], [False]

    def on_event(event) -> None:
        events.append(event)
        if start is not None and isinstance(event, RunStarted):
            setup.release()
            held[0] = False
            start.wait(timeout=300)  # both runs set up before either trains

    if setup is not None:
        held[0] = setup.acquire(timeout=300)
    try:
        result = TrainingSession(cfg, on_event, run_dir=tmp_path / name).run()
    finally:
        if held[0]:  # failed before it started: let the other run load
            setup.release()
    assert not isinstance(result, Failed), result.message + "\n" + result.detail
    return [
        (m.step, m.fast_path_calls, m.fallbacks, m.metadata_builds, m.host_syncs)
        for m in events
        if isinstance(m, StepMetrics)
    ]


def test_two_sessions_training_at_once_report_their_own_counts(tmp_path):
    """Each of two TrainingSessions on threads of one process reports, every step, what a run alone
    reports: the other's forwards are not in its counts."""
    alone = _session_counts(tmp_path, "alone")
    assert len(alone) == 3 and all(calls.get("lora_linears") for _, calls, *_ in alone), alone
    setup, start = threading.Lock(), threading.Barrier(2)
    got: dict[str, list] = {}
    errors: list[BaseException] = []

    def train(name: str) -> None:
        try:
            got[name] = _session_counts(tmp_path, name, setup, start)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got["a"] == alone and got["b"] == alone
