"""A tied output head over a table in host memory (engine.fastpath.host_head), on the CPU: the
streamed loss and its gradient against the fp32 reference (slices that do not divide the
vocabulary, ignored rows, a running max that grows from slice to slice, logit scale, softcap),
the model's loss and LoRA gradients with both ends of the tied table on the host, generation's
logits, and the session moving a tied table when a step runs short, after the free changes and
before halving the micro-batch. The copies' overlap and the memory freed are measured on the GPU
(tests/gpu/test_host_embed_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import FastPathConfig
from engine.data.collate import PackedBatch
from engine.events import MemoryAdjusted, StepMetrics
from engine.fastpath.host_embed import HostEmbedding, host_embedding
from engine.fastpath.host_head import HostHead, slice_rows, streamed_linear_cross_entropy
from engine.kernels.fused_ce import fused_linear_cross_entropy_reference
from engine.peft_model import hf_model
from engine.train.session import Faults
from engine.train.step import forward_loss, prepare_model
from tests.engine.fastpath.test_host_embed import movable_on_the_cpu, short_run, small_model_and_data
from tests.engine.models.test_patches import tiny

CPU = torch.device("cpu")


def _inputs(n=37, h=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    # Rows of growing norm: each slice's logits outgrow the last, so the running max moves and
    # a missing rescale of the sums shows.
    weight = torch.randn(v, h, generator=g) * torch.linspace(0.2, 2.0, v).unsqueeze(1)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("rows", [7, 32, 101, 256])
@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.5, None), (1.0, 3.0)])
def test_streamed_loss_and_gradient_match_the_reference(rows, scale, softcap):
    hidden, weight, targets = _inputs()
    h_ref = hidden.clone().requires_grad_(True)
    ref = fused_linear_cross_entropy_reference(h_ref, weight, targets, logit_scale=scale, softcap=softcap)
    ref.backward()
    h = hidden.clone().requires_grad_(True)
    got = streamed_linear_cross_entropy(
        h, weight, targets, logit_scale=scale, softcap=softcap, slice_rows_override=rows
    )
    got.backward()
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
    assert torch.all(h.grad[::5] == 0)  # ignored rows get no gradient


def test_normalizer_and_no_grad():
    hidden, weight, targets = _inputs(seed=1)
    with torch.no_grad():
        full = streamed_linear_cross_entropy(hidden, weight, targets, slice_rows_override=16)
        summed = streamed_linear_cross_entropy(hidden, weight, targets, normalizer=1.0, slice_rows_override=16)
    kept = int((targets != -100).sum())
    torch.testing.assert_close(summed / kept, full)


def test_slice_rows_bounds():
    assert slice_rows(2048, 2560, 151_936, 2) == 4096  # 32 MiB of fp32 logits
    assert slice_rows(1, 2560, 151_936, 2) == 13_056  # 64 MiB of weight, a multiple of 256
    assert slice_rows(65_536, 4096, 151_936, 2) == 1024  # never below the minimum
    assert slice_rows(4, 64, 300, 4) == 300  # never above the vocabulary


def _tied_model():
    return tiny("qwen3", attn="sdpa", num_hidden_layers=2, tie_word_embeddings=True)


def _batch():
    g = torch.Generator().manual_seed(5)
    return PackedBatch.from_documents([torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 6)])


def _host_tied(model):
    """Both ends of the tied table on the host, as move_to_host does on a GPU (it refuses a CPU:
    there is nothing to free)."""
    base = hf_model(model)
    hosted = HostEmbedding(base.get_input_embeddings(), CPU)
    base.set_input_embeddings(hosted)
    base.set_output_embeddings(HostHead(hosted.host_weight, CPU))


def _step(hosted: bool):
    model = _tied_model()
    prepared = prepare_model(model, FastPathConfig(), CPU, gradient_checkpointing=False)
    if hosted:
        _host_tied(model)
    model.train()
    b = _batch()
    loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, model


def test_tied_table_on_the_host_gives_the_same_loss_and_lora_gradients():
    l0, g0, _ = _step(hosted=False)
    l1, g1, model = _step(hosted=True)
    base = hf_model(model)
    assert isinstance(base.get_output_embeddings(), HostHead)
    assert base.get_output_embeddings().host_weight is host_embedding(model).host_weight  # one copy
    assert not any(p.data_ptr() == base.get_output_embeddings().host_weight.data_ptr() for p in model.parameters())
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-7, msg=n)


def test_generation_logits_from_the_host_head():
    model = _tied_model().eval()
    base = hf_model(model)
    hidden = torch.randn(3, 5, base.config.hidden_size)
    prompt = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        want = base.get_output_embeddings()(hidden)
        want_tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
        _host_tied(model)
        head = base.get_output_embeddings()
        got = head(hidden)
        got_tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)  # chat's path
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    assert "in host memory, tied" in repr(head)
    with pytest.raises(RuntimeError, match="generation only"):
        head(hidden.requires_grad_(True))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return small_model_and_data(tmp_path_factory.mktemp("host-head"), tied=True)


def test_out_of_memory_moves_a_tied_table_before_halving_the_micro_batch(tmp_path, tied, monkeypatch):
    _, straight, events0 = short_run(tmp_path / "a", tied)
    movable_on_the_cpu(monkeypatch)
    session, result, events = short_run(tmp_path / "b", tied, Faults(oom_at_steps=[2]))
    changes = [(e.step, e.setting, e.before, e.after) for e in events if isinstance(e, MemoryAdjusted)]
    assert changes == [(2, "host_embeddings", "device", "host")], changes
    message = next(e.message for e in events if isinstance(e, MemoryAdjusted))
    assert "the tied head streams it" in message, message
    assert isinstance(hf_model(session._model).get_output_embeddings(), HostHead)
    curve = [e.loss for e in events if isinstance(e, StepMetrics)]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4]
    assert curve == pytest.approx([e.loss for e in events0 if isinstance(e, StepMetrics)], rel=1e-5)
