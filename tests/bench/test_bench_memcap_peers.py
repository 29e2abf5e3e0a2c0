"""W7's memory-capped search with the peers users pick, on a CPU: the search, trial and record
code every implementation shares (run on a stand-in for the CUDA memory calls), the Unsloth
child's command line and its record merged into the parent's run, the child's memcap mode
without Unsloth installed, the names the search takes (and why the GPU-only ones cannot run
here), and the single-document steps of HF + PEFT and TRL's SFTTrainer on the tiny model.
No GPU, network or Unsloth needed; no wall-clock assertions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import memcap
from bench.__main__ import build_parser, main, run_memcaps
from bench.memcap import UNFINISHED, UNIT, _make_step, memcap_fields, run_memcap, search_longest
from bench.runner import Budget, NotSupported
from bench.workloads import CPU_TINY, WORKLOADS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/bench/conftest.py

REPO = Path(__file__).resolve().parents[2]
FITS = 40_000  # the stand-in step's longest length


class FakeCuda:
    """torch.cuda's memory calls the search makes, for a 'GPU' of 140 GiB on a CPU."""

    total = 140 * 1024**3

    def __init__(self, monkeypatch):
        self.fractions: list[float] = []
        self.longest = 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "synchronize", lambda d=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: 5 * 1024**3)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: None)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: (5 + self.longest / FITS * 10) * 1024**3)
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, d=None: self.fractions.append(f))


def _fake_step(calls: list, cuda: FakeCuda, error: Exception | None = None):
    """A (model, opt, step) whose step runs out of memory above FITS tokens."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(ids):
        calls.append(len(ids))
        if error is not None:
            raise error
        if len(ids) > FITS:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        cuda.longest = len(ids)

    return model, opt, step


def test_the_shared_search_trial_and_record(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    calls, built = [], []

    def make_step(impl, workload, device, lr, max_tokens):
        built.append((impl, workload.id, device, lr, max_tokens))
        return _fake_step(calls, cuda)

    monkeypatch.setattr(memcap, "_make_step", make_step)
    partial: list[dict] = []
    rec = run_memcap(
        CPU_TINY, "hf_sdpa", torch.device("cuda"), Budget(None), cap_gib=16.0, hi_units=128, lr=2e-3,
        on_trial=partial.append,
    )  # fmt: skip
    # Built once, before the cap, on an indexed device, with the search's longest as max_tokens.
    assert built == [("hf_sdpa", "CPU-tiny", torch.device("cuda", 0), 2e-3, 128 * UNIT)]
    # The same search as before: the same lengths tried in the same order, the same answer.
    want_longest, want_trials = search_longest(lambda n: n <= FITS, 1, 128)
    assert rec["longest_tokens"] == want_longest == 39 * UNIT
    assert [(t["tokens"], t["ok"]) for t in rec["trials"]] == [(t["tokens"], t["ok"]) for t in want_trials]
    assert calls == [t["tokens"] for t in want_trials]
    # Random ids of the trial's length, the cap set for the search and lifted after it.
    assert cuda.fractions == [pytest.approx(16 / 140), 1.0]
    assert rec["status"] == "ok" and rec["cap_gib"] == 16.0 and rec["search_range"] == [UNIT, 128 * UNIT]
    assert rec["weights_gib"] == 5.0 and rec["peak_gib"] == pytest.approx(5 + 39 * UNIT / FITS * 10)
    # After every trial the record as it stands (what the Unsloth child leaves if it is stopped).
    assert len(partial) == len(rec["trials"]) and all(p["status"] == UNFINISHED for p in partial)
    assert [len(p["trials"]) for p in partial] == list(range(1, len(partial) + 1))
    assert partial[-1]["longest_tokens"] == rec["longest_tokens"]
    assert set(partial[-1]) == set(rec)


def test_a_search_from_a_shortest_length(monkeypatch):
    """--memcap-min-tokens: lengths below it are not tried, and a range where nothing trains
    reports 0 (not the untried length below it)."""
    cuda = FakeCuda(monkeypatch)
    calls: list[int] = []
    monkeypatch.setattr(memcap, "_make_step", lambda *a, **k: _fake_step(calls, cuda))
    rec = memcap_fields(
        CPU_TINY, "hf_sdpa", torch.device("cuda"), Budget(None), 16.0, 128 * UNIT, min_tokens=128 * UNIT
    )
    assert calls == [128 * UNIT] and rec["longest_tokens"] == 0 and rec["search_range"] == [128 * UNIT, 128 * UNIT]
    calls.clear()
    rec = memcap_fields(CPU_TINY, "hf_sdpa", torch.device("cuda"), Budget(None), 16.0, 40 * UNIT, min_tokens=36 * UNIT)
    assert min(calls) >= 36 * UNIT and rec["longest_tokens"] == 39 * UNIT


def test_record_fields_say_why_there_is_no_search(monkeypatch):
    # Not on a CPU: no memory cap there.
    assert memcap_fields(CPU_TINY, "hf_sdpa", torch.device("cpu"), Budget(None), 16.0, 8192) == {
        "status": "not supported: the memory-capped search needs a CUDA GPU"
    }
    # Any failure but an OOM ends the search as an error, and the cap is lifted.
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(
        memcap, "_make_step", lambda *a, **k: _fake_step([], cuda, ValueError("a shape that does not fit"))
    )
    out = memcap_fields(CPU_TINY, "hf_sdpa", torch.device("cuda", 0), Budget(None), 16.0, 8192)
    assert out == {"status": "error: ValueError: a shape that does not fit"}
    assert cuda.fractions[-1] == 1.0


@pytest.mark.parametrize(
    "impl,why",
    [
        ("unsloth", "child process"),  # in the bench's own process: transformers is already imported
        ("liger_varlen", "CUDA only"),
        ("hf_varlen", "CUDA only"),
        ("trl_varlen", "CUDA only"),
        ("trl_liger_varlen", "Liger's Triton kernels need a CUDA GPU"),
        ("hf_nope", "memcap has no step for 'hf_nope'"),
        ("trl_eager", "memcap has no step for 'trl_eager'"),
    ],
)
def test_steps_that_cannot_be_built_here_say_why(impl, why):
    with pytest.raises(NotSupported, match=why):
        _make_step(impl, CPU_TINY, torch.device("cpu"), max_tokens=1024)


@pytest.mark.parametrize("impl", ["hf_sdpa", "trl_sdpa"])
def test_a_single_document_step_trains_the_tiny_model(impl):
    """What a trial runs, on the CPU: one document of any length up to max_tokens per step (TRL:
    its SFTTrainer packs and collates that document, padding-free, as in its speed runs)."""
    torch.manual_seed(0)
    model, opt, step = _make_step(impl, CPU_TINY, torch.device("cpu"), lr=1e-2, max_tokens=2 * UNIT)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    inner = getattr(opt, "optimizer", opt)  # TRL's: accelerate's wrapper around the bench's AdamW
    assert type(inner).__name__ == "AdamW" and inner.defaults["lr"] == 1e-2
    vocab = CPU_TINY.config["vocab_size"]
    for n in (700, 2 * UNIT):  # a document shorter than the longest, and the longest
        step(torch.randint(0, vocab, (n,)).tolist())
        opt.zero_grad(set_to_none=True)
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), lora[n])]
    assert any("lora_B" in n for n in moved), "the step did not update the LoRA"


def _memcap_args(tmp_path, *extra: str):
    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True, exist_ok=True)
    return build_parser().parse_args(
        [
            "--memcap",
            "--workloads",
            "W7",
            "--memcap-gib",
            "16",
            "--memcap-max-tokens",
            "131072",
            "--run-id",
            "run-42",
            "--unsloth-site",
            str(site),
            "--results",
            str(tmp_path / "results.jsonl"),
            *extra,
        ]
    )


def test_the_unsloth_child_command_carries_the_search_and_the_run(tmp_path):
    from bench.peers.unsloth import child_command

    args = _memcap_args(tmp_path)
    cmd = child_command("W7", args, Budget(300), 1e-3, tmp_path / "r.json", memcap=True)
    assert cmd[:3] == [sys.executable, "-m", "bench"]
    child = build_parser().parse_args(cmd[3:])  # the child parses what the parent wrote
    assert child.child_impl == "unsloth" and child.memcap and child.workloads == "W7"
    assert (child.memcap_gib, child.memcap_max_tokens, child.run_id, child.lr) == (16.0, 131072, "run-42", 1e-3)
    assert child.memcap_min_tokens == 1024
    assert child.json_out == str(tmp_path / "r.json")
    assert 280 <= child.max_seconds <= 295  # the parent's remaining budget, less a margin
    # No budget: no --max-seconds. The speed child keeps its own arguments.
    assert "--max-seconds" not in child_command("W7", args, Budget(None), 1e-3, tmp_path / "r.json", memcap=True)
    args.steps, args.warmup = 8, 3
    speed = build_parser().parse_args(child_command("W3", args, Budget(None), 1e-3, tmp_path / "r.json")[3:])
    assert not speed.memcap and (speed.steps, speed.warmup, speed.run_id) == (8, 3, "run-42")


class FakeChild:
    """subprocess.Popen for the Unsloth child: writes the record a memcap child writes."""

    def __init__(self, cmd, cwd=None, env=None, rc=0, status="ok", **_):
        self.cmd, self.env, self.rc = cmd, env, rc
        child = build_parser().parse_args(cmd[3:])
        rec = {
            "date": "2099-01-01T00:00:00",
            "run_id": child.run_id,
            "mode": "memcap",
            "versions": {"unsloth": "2099.1"},
            "workload": child.workloads,
            "impl": "unsloth",
            "lr": child.lr,
            "options": {"cap_gib": child.memcap_gib, "max_seq_length": child.memcap_max_tokens},
            "status": status,
            "longest_tokens": 65536,
            "trials": [{"tokens": 65536, "ok": True, "s": 1.0}],
            "cap_gib": child.memcap_gib,
            "peak_gib": 15.2,
            "weights_gib": 5.6,
            "search_range": [1024, child.memcap_max_tokens],
        }
        Path(child.json_out).write_text(json.dumps(rec))
        self.stdout = iter(["loading\n", "W7 unsloth memcap: 65536 tokens -> ok\n"])

    def wait(self):
        return self.rc

    def poll(self):
        return self.rc

    def kill(self):
        pass


def test_run_memcaps_merges_the_unsloth_childs_record(tmp_path, monkeypatch):
    from bench.peers import unsloth

    launched = []

    def popen(cmd, **kw):
        launched.append(FakeChild(cmd, **kw))
        return launched[-1]

    monkeypatch.setattr(unsloth.subprocess, "Popen", popen)
    args = _memcap_args(tmp_path, "--memcap-impls", "unsloth")
    (rec,) = run_memcaps(args, [WORKLOADS["W7"]], torch.device("cuda"), Budget(600), {"gpu": "test"})
    assert len(launched) == 1 and "--memcap" in launched[0].cmd
    assert launched[0].env["PYTHONPATH"].split(os.pathsep)[0] == str((tmp_path / "site").resolve())
    assert (rec["run_id"], rec["impl"], rec["workload"], rec["mode"]) == ("run-42", "unsloth", "W7", "memcap")
    assert rec["status"] == "ok" and rec["longest_tokens"] == 65536 and rec["versions"] == {"unsloth": "2099.1"}
    assert rec["options"] == {"cap_gib": 16.0, "max_seq_length": 131072} and "child_exit" not in rec
    assert [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()] == [rec]

    # A child stopped mid-search: the record of its last finished trial, marked as such.
    monkeypatch.setattr(unsloth.subprocess, "Popen", lambda cmd, **kw: FakeChild(cmd, rc=-9, status=UNFINISHED))
    (rec,) = run_memcaps(args, [WORKLOADS["W7"]], torch.device("cuda"), Budget(600), {"gpu": "test"})
    assert rec["status"] == UNFINISHED and rec["child_exit"] == -9 and rec["longest_tokens"] == 65536


def test_memcap_on_the_cpu_records_every_impl_as_not_supported(tmp_path):
    results = tmp_path / "r.jsonl"
    impls = "unsloth,liger_varlen,trl_varlen,trl_liger_varlen"
    argv = ["--memcap", "--device", "cpu", "--memcap-impls", impls, "--results", str(results), "--run-id", "r1"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["impl"] for r in recs] == impls.split(",")
    for r in recs:
        assert r["status"] == "not supported: the memory-capped search needs a CUDA GPU", r
        assert (r["mode"], r["workload"], r["run_id"]) == ("memcap", "W7", "r1")


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="Unsloth is installed here")
def test_the_unsloth_child_in_memcap_mode_without_unsloth(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "bench", "--child-impl", "unsloth", "--memcap", "--workloads", "W7",
        "--memcap-gib", "16", "--memcap-max-tokens", "9000", "--run-id", "run-7", "--lr", "0.001",
        "--json-out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())
    assert (rec["mode"], rec["impl"], rec["workload"], rec["run_id"]) == ("memcap", "unsloth", "W7", "run-7")
    assert rec["status"].startswith("not supported: unsloth does not import"), rec["status"]
    assert rec["options"]["max_seq_length"] == 8192 and rec["options"]["load_in_4bit"] is True
    assert rec["versions"]["unsloth"] is None
