"""The input embedding in host memory (engine.fastpath.host_embed), on the CPU: the same loss and
LoRA gradients as the table on the device, who may move it (untied, frozen, on a GPU), and the
session moving it as its first memory change when a step runs out of memory, with a curve
equal to the run that never ran short. The memory it frees is measured on the GPU
(tests/gpu/test_host_embed_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import FastPathConfig, LoraConfig
from engine.data.collate import PackedBatch
from engine.events import MemoryAdjusted, StepMetrics
from engine.fastpath import host_embed
from engine.fastpath.host_embed import HostEmbedding, host_embedding, is_tied, move_to_host, why_not
from engine.train.session import Faults
from engine.train.step import forward_loss, prepare_model
from tests.engine.models.test_patches import tiny
from tests.learning_parity import learnable_jsonl, make_config, random_model_folder

CPU = torch.device("cpu")


def batch():
    g = torch.Generator().manual_seed(5)
    return PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 6)])


def step(hosted: bool, model_type: str = "qwen3"):
    model = tiny(model_type, attn="sdpa", num_hidden_layers=2, tie_word_embeddings=False)
    prepared = prepare_model(model, FastPathConfig(), CPU, gradient_checkpointing=False)
    if hosted:  # on a CPU the session never offers it (nothing to free); the module works alike
        from engine.peft_model import hf_model

        base = hf_model(model)
        base.set_input_embeddings(HostEmbedding(base.get_input_embeddings(), CPU))
    model.train()
    b = batch()
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, model


# Gemma-3's embedding module scales its rows (ScaledWordEmbedding): the host table keeps the scale.
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_host_table_gives_identical_loss_and_gradients(model_type):
    l0, g0, _ = step(hosted=False, model_type=model_type)
    l1, g1, model = step(hosted=True, model_type=model_type)
    assert host_embedding(model) is not None
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_host_table_answers_device_ids_too():
    emb = torch.nn.Embedding(50, 8)
    hosted = HostEmbedding(emb, CPU)
    ids = torch.tensor([[3, 1, 49, 3]])
    assert torch.equal(hosted(ids), emb(ids).detach())
    assert hosted.weight.shape == (50, 8) and "in host memory" in repr(hosted)


def test_a_scaled_lookup_moves_and_an_embedding_that_does_more_stays():
    gemma = tiny("gemma3_text").get_input_embeddings()
    assert type(gemma).__name__ == "Gemma3TextScaledWordEmbedding"
    hosted = HostEmbedding(gemma, CPU)
    assert host_embed.same_lookup(gemma, hosted)
    ids = torch.tensor([[5, 0, 127]])
    assert torch.equal(hosted(ids), gemma(ids)) and not torch.equal(hosted(ids), gemma.weight[ids])

    class Shifted(torch.nn.Embedding):  # a forward that does more than a scaled lookup
        def forward(self, ids):
            return super().forward(ids) + 1.0

    shifted = Shifted(50, 8)
    assert not host_embed.same_lookup(shifted, HostEmbedding(shifted, CPU))


def test_who_may_move_the_table():
    untied = tiny("qwen3", attn="sdpa", num_hidden_layers=1, tie_word_embeddings=False)
    tied = tiny("qwen3", attn="sdpa", num_hidden_layers=1, tie_word_embeddings=True)
    assert why_not(untied, CPU) == "the model is not on a GPU"
    assert move_to_host(untied, CPU) == "off: the model is not on a GPU"
    assert why_not(untied, "cuda") == "" and why_not(tied, "cuda") == ""  # a tied head streams it
    assert is_tied(tied) and not is_tied(untied)


def small_model_and_data(root, tied: bool):
    """(model folder, learnable data) of a 2-layer Qwen3 with or without a tied head, for runs
    through the session (shared with tests/engine/fastpath/test_host_head.py)."""
    folder = random_model_folder(
        root / "model",
        "qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    return folder, learnable_jsonl(root, docs=120)


def short_run(tmp_path, model_and_data, faults=None):
    """4 steps of 2 rows of 64 tokens in fp32, no pre-flight: (session, result, events)."""
    from tests.engine.train.test_recovery import train

    folder, data = model_and_data
    cfg = make_config(str(folder), data, tmp_path, steps=4, seq=64, rows=2, preflight="off")
    cfg.model.dtype = "float32"
    return train(cfg, tmp_path / "run", faults)


def movable_on_the_cpu(monkeypatch):
    """A CPU has no device table to free: let the session treat the table as movable, as on a GPU."""
    monkeypatch.setattr(host_embed, "why_not", lambda model, device: "" if host_embedding(model) is None else "moved")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return small_model_and_data(tmp_path_factory.mktemp("host-embed"), tied=False)


def test_out_of_memory_moves_the_table_to_host_first_and_loses_nothing(tmp_path, untied, monkeypatch):
    _, straight, events0 = short_run(tmp_path / "a", untied)
    movable_on_the_cpu(monkeypatch)
    session, result, events = short_run(tmp_path / "b", untied, Faults(oom_at_steps=[2]))
    changes = [(e.step, e.setting, e.before, e.after) for e in events if isinstance(e, MemoryAdjusted)]
    assert changes == [(2, "host_embeddings", "device", "host")], changes
    message = next(e.message for e in events if isinstance(e, MemoryAdjusted))
    assert message.startswith("input embeddings → host memory ("), message
    assert host_embedding(session._model) is not None
    curve = [e.loss for e in events if isinstance(e, StepMetrics)]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4]
    assert curve == pytest.approx([e.loss for e in events0 if isinstance(e, StepMetrics)], rel=1e-5)


def _nf4_model(tied: bool, quantized: bool = True):
    """A tiny LoRA Qwen3 on NF4 (bitsandbytes Linear4bit) bases, its head tied or not."""
    from bench.workloads import quantize_nf4
    from engine.models.lora import attach_lora
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3", num_hidden_layers=1, tie_word_embeddings=tied)
    if quantized:
        quantize_nf4(model, compute_dtype=torch.float32)
    return attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))


def test_auto_moves_a_4bit_bases_untied_table_from_the_start(monkeypatch):
    # QLoRA is chosen to save memory, and an untied table costs no matmul in host memory: auto
    # moves it in prepare_model. A 16-bit base, a tied 4-bit one, or the setting off keep it.
    pytest.importorskip("bitsandbytes")
    movable_on_the_cpu(monkeypatch)

    def hosted(model, setting="auto"):
        report = prepare_model(model, FastPathConfig(host_embeddings=setting), CPU, gradient_checkpointing=False)
        return report.report["host_embeddings"], host_embedding(model) is not None

    line, moved = hosted(_nf4_model(tied=False))
    assert moved and line.startswith("on: auto for a 4-bit base's untied table, "), line
    assert hosted(_nf4_model(tied=False, quantized=False)) == ("off: moved when memory runs short", False)
    assert hosted(_nf4_model(tied=True)) == ("off: moved when memory runs short", False)
    assert hosted(_nf4_model(tied=False), setting=False) == ("off: disabled in config", False)
