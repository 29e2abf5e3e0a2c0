"""The peers users pick, on a CPU: TRL's SFTTrainer with padding-free packing trains the bench's
tiny model on the bench's batches (same tokens per step as ours, same first loss as stock
HF + PEFT, a loss that falls); the GPU-only peers (Liger, torch's varlen flash attention) say
why they cannot run here; and the varlen attention function, run against a reference kernel
(per-document causal SDPA standing in for FlashAttention, which has no CPU kernel), gives the
same loss as stock SDPA with transformers' packed mask. No wall-clock assertions."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from bench.batches import make_batches
from bench.runner import ADAMW, Budget, Context, run_impl, setup_for
from bench.workloads import CPU_TINY, build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/bench/conftest.py


def _run(impl: str, batches, warmup: int = 1, steps: int = 2) -> dict:
    ctx = Context(CPU_TINY, batches, torch.device("cpu"), warmup, steps, Budget(None), None, lr=1e-2)
    return run_impl(setup_for(impl, {}), ctx, impl, {}, {})


def test_trl_sft_trainer_trains_the_same_tokens_as_ours():
    from engine.data.collate import PackedBatch

    batches = make_batches(3, CPU_TINY.tokens, CPU_TINY.config["vocab_size"])
    trl_rec = _run("trl_sdpa", batches)
    assert trl_rec["status"] == "ok", trl_rec["status"]
    curve = trl_rec["loss_curve"]
    assert len(curve) == 3 and all(math.isfinite(x) for x in curve)
    assert curve[-1] < curve[0]  # lr 1e-2 on learnable ids: the loss falls within three steps

    # The same tokens per step as ours (the engine's PackedBatch of the same documents), and the
    # same trained targets: every next token within a document.
    packed = [PackedBatch.from_documents(b.documents()) for b in batches]
    assert trl_rec["tokens_per_step"] == [p.num_tokens for p in packed]
    assert trl_rec["trained_tokens_per_step"] == [p.num_trained_tokens for p in packed]

    # What TRL did, in the record.
    opts = trl_rec["options"]
    assert opts["trainer"].startswith("trl.SFTTrainer")
    assert opts["packing"] is True and opts["packing_strategy"] == "bfd" and opts["padding_free"] is True
    assert opts["attn_implementation_used"] == "sdpa"
    assert opts["collator"] == "DataCollatorForLanguageModeling"
    # Padding-free: position_ids and the flash-attention boundaries, no padded attention mask.
    assert {"position_ids", "cu_seq_lens_q", "max_length_q", "labels"} <= set(opts["collator_keys"])
    assert "attention_mask" not in opts["collator_keys"]
    assert opts["max_grad_norm"] == 0.0 and opts["lr_scheduler"] == "constant"
    opt = opts["optimizer"]
    assert (opt["name"], opt["lr"], opt["weight_decay"], tuple(opt["betas"]), opt["eps"]) == (
        "AdamW",
        1e-2,
        ADAMW["weight_decay"],
        ADAMW["betas"],
        ADAMW["eps"],
    )

    # Same weights, LoRA and targets as stock HF + PEFT: the same first loss (before any update).
    hf_rec = _run("hf_sdpa", batches, warmup=0, steps=1)
    assert hf_rec["status"] == "ok", hf_rec["status"]
    assert curve[0] == pytest.approx(hf_rec["loss_curve"][0], rel=1e-4)


@pytest.mark.parametrize(
    "impl,why",
    [
        ("trl_liger", "CUDA"),
        ("trl_liger_varlen", "CUDA"),
        ("trl_varlen", "CUDA only"),
        ("trl_flex", "CPU"),
        ("hf_varlen", "CUDA only"),
        ("liger_varlen", "CUDA"),
    ],
)
def test_gpu_only_peers_say_why_on_the_cpu(impl, why):
    rec = _run(impl, make_batches(1, CPU_TINY.tokens, CPU_TINY.config["vocab_size"]), warmup=0, steps=1)
    assert rec["status"].startswith("not supported: ") and why in rec["status"], rec["status"]


def test_new_peers_are_registered():
    from bench.__main__ import KNOWN_IMPLS
    from bench.report import PEER_IMPLS

    for impl in ("hf_varlen", "liger_varlen", "trl_sdpa", "trl_liger", "trl_varlen", "trl_liger_varlen"):
        assert impl in KNOWN_IMPLS and impl in PEER_IMPLS
        assert callable(setup_for(impl, {}))
    with pytest.raises(SystemExit):
        setup_for("trl_eager_nope", {})


def _reference_varlen(new_signature: bool):
    """A stand-in for varlen_attn with the same call: causal SDPA one document at a time."""

    def attend(q, k, v, cu_q, cu_k):
        assert q.dim() == 3 and q.shape[0] == int(cu_q[-1]) and torch.equal(cu_q, cu_k)
        outs = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qq, kk, vv = (x[a:b].transpose(0, 1) for x in (q, k, v))
            gqa = kk.shape[0] != qq.shape[0]
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa).transpose(0, 1))
        return torch.cat(outs)

    if new_signature:  # torch >= 2.11: window_size, enable_gqa, scale

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0) and (enable_gqa or q.shape[1] == k.shape[1])
            assert scale == pytest.approx(q.shape[-1] ** -0.5)
            return attend(q, k, v, cu_q, cu_k)

    else:  # torch 2.10: is_causal, no GQA

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
            assert is_causal and q.shape[1] == k.shape[1]
            return attend(q, k, v, cu_q, cu_k)

    return varlen_attn


@pytest.mark.parametrize("new_signature", [True, False])
def test_varlen_attention_matches_packed_sdpa(monkeypatch, new_signature):
    from bench.peers import varlen

    calls = []
    ref = _reference_varlen(new_signature)

    @functools.wraps(ref)  # the function reads the kernel's signature (which causal/GQA call)
    def counted(*a, **k):
        calls.append(1)
        return ref(*a, **k)

    monkeypatch.setattr(varlen, "_varlen_fn", lambda: (counted, None))
    batch = make_batches(1, CPU_TINY.tokens, CPU_TINY.config["vocab_size"])[0]
    assert len(batch.lengths) > 1  # several documents: attention must not cross them
    inputs = batch.hf_inputs()
    assert CPU_TINY.config["num_key_value_heads"] < CPU_TINY.config["num_attention_heads"]  # the GQA path

    def loss(attn, **extra):
        model = build_model(CPU_TINY, dtype=torch.float32, device=torch.device("cpu"), attn_implementation=attn)
        model.train()
        out = model(**inputs, **extra, use_cache=False)
        out.loss.backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad
        return out.loss.detach(), grad

    ref_loss, ref_grad = loss("sdpa")
    name = varlen.register()
    # Boundaries from the collator-style kwargs, and (no kwargs) from the packed position_ids.
    for extra in (varlen.varlen_kwargs(batch.lengths), {}):
        calls.clear()
        got_loss, got_grad = loss(name, **extra)
        # Every layer went through it, forward and (checkpointing off) nothing else.
        assert len(calls) == CPU_TINY.config["num_hidden_layers"]
        assert got_loss == pytest.approx(float(ref_loss), rel=1e-5)
        torch.testing.assert_close(got_grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_cu_seqlens_from_positions():
    from bench.peers.varlen import cu_seqlens_from_positions, varlen_kwargs

    batch = make_batches(1, 2048, 1000)[0]
    cu, longest = cu_seqlens_from_positions(batch.position_ids().unsqueeze(0))
    kw = varlen_kwargs(batch.lengths)
    assert torch.equal(cu, kw["cu_seq_lens_q"]) and cu.dtype == torch.int32
    assert longest == kw["max_length_q"] == max(batch.lengths)
