"""FSDP and the families whose layers carry state along a row (Arch.row_state): each document of a
packed row is its own forward there, and under FSDP every forward gathers each layer from all
ranks, so ranks holding different numbers of documents would hang. The combination is refused
before the process group is joined (engine.train.run_setup.configure, from the config.json on
disk) and again when sharding a loaded model (engine.train.fsdp.shard); DDP, which the refusal
points to, is checked to stay in step with different numbers of forwards per rank (two gloo
processes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from child_process import child_env

from engine.config import ConfigError, RunConfig
from engine.models.arch import ARCHS
from engine.resources import DEMO_PRESET
from engine.train.distributed import DistContext
from engine.train.fsdp import alone_refusal, shard
from engine.train.run_setup import configure

TWO_RANKS = DistContext(rank=0, world_size=2, local_rank=0)


def _lfm2_folder(tmp_path):
    folder = tmp_path / "lfm2-tiny"
    folder.mkdir()
    config = dict(
        model_type="lfm2",
        architectures=["Lfm2ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        layer_types=["conv", "full_attention"],
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _config(tmp_path, model: str, distributed: str) -> RunConfig:
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.name_or_path = model
    cfg.output.dir = str(tmp_path / "runs")
    cfg.training.device = "cpu"
    cfg.training.grad_accum = 2  # a plan two processes can share
    cfg.training.distributed = distributed
    return cfg


def test_every_row_state_family_is_refused_under_fsdp_naming_it_and_the_way_out():
    families = sorted(name for name, arch in ARCHS.items() if arch.row_state)
    assert {"lfm2", "jamba", "nemotron_h", "granitemoehybrid", "bamba", "qwen3_5", "qwen3_next"} <= set(families)
    for name in families:
        why = alone_refusal(name)
        assert why is not None and name in why, name
        assert "training.distributed: ddp" in why and "one GPU" in why
    # Families checked to pack their rows whole shard as before, and so does a model whose type
    # is not known yet (shard() asks again once it has loaded); a family nobody has checked runs
    # each document alone, so FSDP refuses it too, saying why.
    for name in ("llama", "qwen3", "mistral", "afmoe", None):
        assert alone_refusal(name) is None, name
    why = alone_refusal("not_a_family")
    assert "not a family the engine has checked keeps the documents of a packed row apart" in why


def test_configure_refuses_fsdp_for_a_row_state_model_before_joining_the_process_group(tmp_path):
    # Two ranks' context in one process: were the refusal after dist.init, this would wait for a
    # second rank (or fail on the missing MASTER_ADDR) instead of raising.
    cfg = _config(tmp_path, str(_lfm2_folder(tmp_path)), "fsdp")
    with pytest.raises(ConfigError) as err:
        configure(cfg, TWO_RANKS, None, None, None)
    assert err.value.path == "training.distributed"
    assert "fsdp cannot train lfm2" in str(err.value) and "training.distributed: ddp" in str(err.value)
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "runs").exists()  # refused before any folder


def test_sharding_a_loaded_row_state_model_is_refused_before_any_collective():
    # A Hub id whose config.json was not on disk at configure time: the loaded model's config says it.
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        "lfm2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        layer_types=["conv", "full_attention"],
    )
    model = AutoModelForCausalLM.from_config(hf_config)
    with pytest.raises(ConfigError, match="fsdp cannot train lfm2"):
        shard(model, lambda *a: None, torch.device("cpu"), 2)
    assert not torch.distributed.is_initialized()


# Each rank runs its own number of forwards of one layer inside one DDP forward (as a row_state
# model runs one per document), then one backward; it writes the gradient DDP left.
_DDP_RANK = r"""
import sys, torch
from torch import nn
from engine.train.distributed import DistContext

dist = DistContext.from_env()
dist.init(torch.device("cpu"))
torch.manual_seed(0)
layer = nn.Linear(4, 3)  # the same start on every rank

def loss_fn(inner, docs, normalizer):
    return sum(inner(x).pow(2).sum() for x in docs) / normalizer  # one forward per document

ddp = dist.wrap(layer, loss_fn, torch.device("cpu"))
docs = [torch.full((1, 4), float(dist.rank * 10 + i + 1)) for i in range(1 + 2 * dist.rank)]
ddp(docs, 1.0).backward()
torch.save({"weight": layer.weight.grad, "bias": layer.bias.grad}, sys.argv[1])
# The session's own teardown: every rank at the barrier, then the group destroyed. DDP goes
# first so no reducer outlives its group. os._exit skips the interpreter's finalization, where
# gloo's worker threads once aborted a rank in CI ("terminate called without an active
# exception", rc -6) after its gradients were written: what this test checks ends above.
dist.barrier()
del ddp
import gc, os
gc.collect()
dist.close()
sys.stderr.flush()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_stays_in_step_when_ranks_run_different_numbers_of_forwards(tmp_path):
    port = str(_free_port())
    procs, outs = [], []
    for rank in range(2):
        out = tmp_path / f"grad-{rank}.pt"
        env = child_env(
            OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
        )
        env["MASTER_PORT"] = port
        procs.append(subprocess.Popen([sys.executable, "-c", _DDP_RANK, str(out)], env=env, stderr=subprocess.PIPE))
        outs.append(out)
    try:
        errors = [p.communicate(timeout=300)[1].decode()[-2000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    # What each rank's own documents give (1 forward on rank 0, 3 on rank 1), averaged as DDP does.
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    grads = []
    for rank in range(2):
        ref.zero_grad()
        docs = [torch.full((1, 4), float(rank * 10 + i + 1)) for i in range(1 + 2 * rank)]
        sum(ref(x).pow(2).sum() for x in docs).backward()
        grads.append((ref.weight.grad.clone(), ref.bias.grad.clone()))
    want_w = (grads[0][0] + grads[1][0]) / 2
    want_b = (grads[0][1] + grads[1][1]) / 2
    for out in outs:
        got = torch.load(out)
        torch.testing.assert_close(got["weight"], want_w)
        torch.testing.assert_close(got["bias"], want_b)
