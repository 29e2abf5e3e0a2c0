"""What actually ran: engine.counters per step, on tiny models on the CPU.

The fast-path report of prepare_model says what was patched; these tests check that the
counters say what ran: the fused LoRA Functions, each kernel op by path (the torch references
on a CPU, the Triton kernels through the interpreter), the attention backend, and every fallback
to a stock forward with its reason. Also: host reads in a step are all counted (a real sniffer,
not a counter set by hand), the TrainingSession puts the counts into StepMetrics and logs a
fallback once, and `requested_but_not_run` names a requested path that did not run.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import FastPathConfig, LoraConfig
from engine.counters import (
    BASE_KEYS,
    count,
    count_fallback,
    current,
    requested_but_not_run,
    reset_counters,
    split_counts,
)
from engine.data.collate import PackedBatch
from engine.models.lora import attach_lora
from engine.train.step import forward_loss, prepare_model
from tests.tiny_models import tiny_model

CPU = torch.device("cpu")
LAYERS = 2
ON = FastPathConfig(kernels=True, lora_autograd=True, fused_ce=True, packed_attention=True, moe_grouping=True)
LENGTHS = (9, 6, 13)


def tiny(model_type="llama", dropout=0.0, **extra):
    """A tiny model (tests/tiny_models.py) with the engine's LoRA."""
    return attach_lora(tiny_model(model_type, **extra), LoraConfig(r=4, alpha=8.0, dropout=dropout))


def batch(seed=1) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]
    return PackedBatch.from_documents(docs)


def one_step(model, b=None):
    """forward_loss + backward of one micro-batch; the counts it made, split."""
    b = b or batch()
    reset_counters()
    loss = forward_loss(model, b, b.num_trained_tokens)
    loss.backward()
    snap = reset_counters()
    calls, fallbacks = split_counts(snap)
    return snap, calls, fallbacks


# -- the counters themselves ---------------------------------------------------------------------


def test_reset_keeps_base_keys_and_drops_zero_and_fallback_entries():
    reset_counters()
    for _ in range(3):
        count("lora_mlp")
    count_fallback("attention", "KV cache")
    count_fallback("attention", "KV cache")
    snap = reset_counters()
    assert snap == {
        "metadata_builds": 0,
        "host_syncs": 0,
        "moe_calls": 0,
        "lora_mlp": 3,
        "fallback:attention: KV cache": 2,
    }
    assert split_counts(snap) == ({"lora_mlp": 3}, {"attention: KV cache": 2})
    assert not any(k.startswith("fallback:") for k in current()) and not any(current().values())
    assert reset_counters() == {k: 0 for k in BASE_KEYS}


def test_requested_but_not_run():
    report = {
        "lora_qkv": "on",
        "lora_o": "on",
        "lora_mlp": "partial 1/2: lora dropout 0.1 > 0",
        "rmsnorm": "on",
        "rope": "off: fast_paths.kernels is false",
        "packed_attention": "on",
        "fused_ce": "on",
        "offload": "on: single buffer, 2 layers",
        "cached_metadata": "on",
    }
    calls = {"lora_linears": 4, "rmsnorm:torch": 5, "attention:reference": 2, "fused_ce:torch": 1}
    # lora_mlp was requested (partial) and never ran; rope was off; offload is not observable.
    assert requested_but_not_run(report, calls) == {"lora_mlp": "did not run"}
    got = requested_but_not_run(report, {**calls, "lora_mlp": 1}, {"lora_o: adapters disabled": 2})
    assert list(got) == ["lora_o"] and got["lora_o"].startswith("ran on some layers only")
    assert "adapters disabled (2x)" in got["lora_o"]
    # A whole-attention fallback takes q/k/v and o with it.
    got = requested_but_not_run(
        report,
        {"lora_mlp": 2, "rmsnorm:torch": 5, "attention:reference": 2, "fused_ce:torch": 1},
        {"attention: autocast": 2},
    )
    assert got == {"lora_qkv": "did not run: autocast (2x)", "lora_o": "did not run: autocast (2x)"}
    # On a GPU, a kernel path that ran only its torch reference is named.
    ran = {**calls, "lora_mlp": 1}
    assert requested_but_not_run(report, ran, device="cpu") == {}
    gpu = requested_but_not_run(report, ran, device="cuda:0")
    assert set(gpu) == {"rmsnorm", "packed_attention", "fused_ce"}
    assert all("torch reference" in v for v in gpu.values())


# -- a tiny model on the CPU -----------------------------------------------------------------------


def test_cpu_step_runs_fused_lora_and_kernel_references_without_fallbacks(host_reads):
    model = tiny()
    report = prepare_model(model, ON, CPU, gradient_checkpointing=False).report
    assert all(
        report[k] == "on"
        for k in ("lora_qkv", "lora_o", "lora_mlp", "rmsnorm", "rope", "activations", "packed_attention", "fused_ce")
    )
    model.train()
    b = batch()  # built on the host before the step, as the collator does
    host_reads.clear()
    snap, calls, fallbacks = one_step(model, b)
    assert fallbacks == {}
    assert calls["lora_linears"] == 2 * LAYERS  # q/k/v together, then o
    assert calls["lora_mlp"] == LAYERS
    assert calls["rmsnorm:torch"] == 2 * LAYERS + 1  # two per layer and the final norm
    assert calls["rope:torch"] == LAYERS
    # The MLP's activation: once in its forward, once more in its backward (h is rebuilt).
    assert calls["activations:torch"] == 2 * LAYERS
    assert calls["attention:reference"] == LAYERS
    assert calls["fused_ce:torch"] == 1
    assert not any(k.endswith(":triton") for k in calls)
    assert requested_but_not_run(report, calls, fallbacks, "cpu") == {}
    # Host reads: every one the step made is counted, and the only ones are the reference
    # attention's (one cu_seqlens.tolist() per layer), which a GPU does not run. A read added
    # anywhere in the decoder layers (counted or not) fails this.
    assert snap["host_syncs"] == len(host_reads) == calls["attention:reference"], host_reads
    assert snap["metadata_builds"] == 0  # built once by the batch, before the step


def test_gradient_checkpointing_counts_the_recompute():
    model = tiny()
    prepare_model(model, ON, CPU, gradient_checkpointing=True)
    model.train()
    _, calls, fallbacks = one_step(model)
    assert fallbacks == {}
    assert calls["lora_linears"] == 4 * LAYERS and calls["lora_mlp"] == 2 * LAYERS


def test_triton_kernels_through_the_interpreter_read_nothing_on_the_host(host_reads):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    from engine.fastpath.attention import enable_packed_attention
    from engine.models.patches import apply_fast_paths

    model = tiny("qwen3", num_hidden_layers=1)
    prepare_model(model, ON, CPU, gradient_checkpointing=False)
    apply_fast_paths(model, ON, CPU, kernel_impl="triton")
    assert enable_packed_attention(model, backend="triton") == "on"
    model.train()
    b = batch()
    # A first step builds the batch's attention block tables on the host (moving a batch to a
    # GPU queues them, PackedSeqInfo.to); the second step is the one watched.
    one_step(model, b)
    model.zero_grad(set_to_none=True)
    host_reads.clear()
    snap, calls, fallbacks = one_step(model, b)
    assert fallbacks == {}
    assert calls["rmsnorm:triton"] == 1 + 2 + 2  # layer norms + final norm, Qwen3's q/k norms
    assert calls["rope:triton"] == 1 and calls["attention:varlen_triton"] == 1
    assert calls["activations:triton"] == 2  # the fused MLP's forward and its backward rebuild
    assert not any(k in calls for k in ("rmsnorm:torch", "rope:torch", "activations:torch", "attention:reference"))
    # The GPU's path: no host read at all in the decoder layers.
    assert snap["host_syncs"] == 0 and host_reads == []


def test_autocast_falls_back_with_its_reason():
    model = tiny()
    report = prepare_model(model, ON, CPU, gradient_checkpointing=False).report
    model.train()
    b = batch()
    reset_counters()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward_loss(model, b, b.num_trained_tokens).backward()
    calls, fallbacks = split_counts(reset_counters())
    # The attention's output comes back in the cast dtype: the fused add + norm takes the stock ops.
    assert fallbacks == {"attention: autocast": LAYERS, "mlp: autocast": LAYERS, "add_rmsnorm: autocast": LAYERS}
    assert "lora_linears" not in calls and "lora_mlp" not in calls
    missing = requested_but_not_run(report, calls, fallbacks, "cpu")
    for path in ("lora_qkv", "lora_o", "lora_mlp", "rope", "activations", "add_rmsnorm"):
        assert missing[path] == f"did not run: autocast ({LAYERS}x)", missing


def test_disabled_adapter_stays_on_the_fused_path():
    # The reference pass of DPO/KTO/GRPO: the fused Functions run the base alone, nothing falls back.
    model = tiny()
    report = prepare_model(model, ON, CPU, gradient_checkpointing=False).report
    model.eval()
    b = batch()
    reset_counters()
    with torch.no_grad(), model.disable_adapter():
        forward_loss(model, b, b.num_trained_tokens)
    calls, fallbacks = split_counts(reset_counters())
    assert fallbacks == {}
    assert calls["lora_linears"] == 2 * LAYERS and calls["lora_mlp"] == LAYERS
    assert requested_but_not_run(report, calls, fallbacks, "cpu") == {}


def test_kv_cache_generation_counts_the_stock_attention():
    model = tiny()
    prepare_model(model, ON, CPU, gradient_checkpointing=False)
    model.eval()
    base = model.get_base_model()
    base.config.use_cache = True
    reset_counters()
    with torch.no_grad():
        base.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    _, fallbacks = split_counts(reset_counters())
    assert fallbacks.get("attention: KV cache", 0) >= LAYERS


def test_lora_dropout_is_reported_off_and_never_counted():
    model = tiny(dropout=0.05)
    report = prepare_model(model, ON, CPU, gradient_checkpointing=False).report
    assert report["lora_mlp"] == report["lora_qkv"] == "off: lora dropout 0.05 > 0"
    model.train()
    _, calls, fallbacks = one_step(model)
    assert "lora_linears" not in calls and "lora_mlp" not in calls and fallbacks == {}
    assert requested_but_not_run(report, calls, fallbacks, "cpu") == {}  # off was not requested


# -- the TrainingSession ---------------------------------------------------------------------------


def _session_config(tmp_path, steps=2):
    from engine.config import RunConfig
    from engine.resources import DEMO_PRESET

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.data.max_examples = 24
    cfg.data.max_seq_len = 96
    cfg.training.max_steps = steps
    cfg.training.rows_per_micro_batch = 1
    cfg.training.grad_accum = 2
    cfg.training.save_every = 0
    cfg.fast_paths = FastPathConfig(kernels=True, lora_autograd=True, fused_ce=True)
    cfg.output.dir = str(tmp_path)
    return cfg


def _run(cfg):
    from engine.events import Failed, LogLine, StepMetrics
    from engine.train.session import TrainingSession

    events = []
    result = TrainingSession(cfg, events.append).run()
    assert not isinstance(result, Failed), result.message + "\n" + result.detail
    steps = [e for e in events if isinstance(e, StepMetrics)]
    logs = [e for e in events if isinstance(e, LogLine)]
    return steps, logs


def test_session_puts_what_ran_into_step_metrics(tmp_path):
    steps, logs = _run(_session_config(tmp_path))
    assert len(steps) == 2
    layers = 4  # the demo model
    for m in steps:
        assert m.fallbacks == {}
        assert m.fast_path_calls["lora_linears"] == 2 * 2 * layers  # two micro-batches
        assert m.fast_path_calls["lora_mlp"] == 2 * layers
        assert m.fast_path_calls["fused_ce:torch"] == 2
        assert m.fast_path_calls["attention:reference"] == 2 * layers
        assert m.host_syncs == m.fast_path_calls["attention:reference"]
        assert all(v > 0 for v in m.fast_path_calls.values())
    assert not [e for e in logs if "Fast path" in e.message]
    # The event round-trips through the run folder's JSON lines.
    from engine.events import event_from_dict

    again = event_from_dict(steps[0].to_dict())
    assert again.fast_path_calls == steps[0].fast_path_calls and again.fallbacks == {}


def test_session_logs_a_fallback_once(tmp_path, monkeypatch):
    from engine.fastpath import lora_group

    # Every fused projection refuses at run time (as a disabled adapter would).
    monkeypatch.setattr(lora_group, "runtime_ok", lambda parts, x: False)
    steps, logs = _run(_session_config(tmp_path, steps=3))
    for m in steps:
        assert set(m.fallbacks) == {
            "lora_qkv: runtime check failed",
            "lora_o: runtime check failed",
            "lora_mlp: runtime check failed",
        }
        assert "lora_linears" not in m.fast_path_calls
    said = [e for e in logs if e.message.startswith("Fast path")]
    # Three fallback reasons and three requested paths that did not run: each said once, as
    # a note on the CPU (a warning on a GPU).
    assert len(said) == 6 and all(e.level == "info" for e in said), [e.message for e in said]
    assert sum("lora_mlp: runtime check failed" in e.message for e in said) == 1


def test_fallback_on_a_gpu_is_a_warning():
    from engine.train.reporting import Reporter

    logs = []
    reporter = Reporter(logs.append)
    fast = {"lora_mlp": "on", "lora_qkv": "on", "lora_o": "on"}
    for step in (1, 2):
        reporter.say_what_did_not_run(fast, {"lora_linears": 8}, {"lora_mlp: autocast": 4}, "cuda:0", step)
    assert [e.level for e in logs] == ["warning", "warning"]
    assert "lora_mlp: autocast" in logs[0].message and "lora_mlp" in logs[1].message


# -- a real host-read sniffer (see also tests/engine/fastpath/test_moe.py) ---------------------------------

_READS_HOST = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


@pytest.fixture
def host_reads(monkeypatch):
    """Every Tensor method call that reads values on the host (a device sync on CUDA)."""
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name in _READS_HOST:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    return calls
