"""GRPO's own decode loop (engine.train.decoding) against transformers' `generate`, on tiny
patched models with LoRA on a CPU: the same completions for a seed (sampling with temperature
and top-p, and greedy; sliding windows, GPT-OSS's sinks and Gemma-3's sandwich norms and
per-layer-type rotary tables included), the same cut at end-of-turn
tokens, the loop actually taken (not the fallback), no host read-back per token, and fewer ops
per decoding step than `generate`."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from engine.config import FastPathConfig
from engine.models.arch import arch_for
from engine.models.arch.spec import TINY_BASE
from engine.models.patches import apply_fast_paths
from engine.train import decoding
from engine.train.objectives.grpo import generate_completions, sample_completions
from tests.tiny_models import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50]]


# What a family's tiny model needs here: GPT-OSS has no SDPA attention in transformers (eager),
# and its tiny config's window (128 tokens) is longer than these sequences, so it gets the 8
# tokens the tiny Qwen2, Mistral, Ministral and Gemma-3 configs have: every windowed layer reads
# a band. A family with no tiny config in engine/models/arch (StarCoder2) is built from TINY_BASE.
FAMILY = {
    "gpt_oss": dict(attn="eager", sliding_window=8),
    "gemma2": dict(attn="eager"),  # no SDPA attention (softcaps); its tiny config has them and a window
    # Phi-3's window comes from its config; Phi-4-mini rotates part of each head (0.75 there; half
    # here, which GPT-OSS's half-width tables would also match, so the two readings must differ).
    "phi3": dict(sliding_window=8, partial_rotary_factor=0.5),
    # Multipliers that are not 1 (the config's defaults), so a loop that forgot one would differ.
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2),
}


def patched(model_type="qwen3", fast=True, **kw):
    """A tiny LoRA model with the fast paths on (as on a GPU), or stock (the CPU policy's).
    Attention sinks are drawn at a trained model's scale (GPT-OSS's init, N(0, 0.02), would
    hide a loop that ignored them)."""
    settings = {**FAMILY.get(model_type, {}), **kw}
    if arch_for(model_type).tiny is None:  # no tiny config of its own: TINY_BASE's sizes
        settings = dict(config=AutoConfig.for_model(model_type, **{**TINY_BASE, **settings}))
    model = tiny_model(model_type, lora={}, lora_b_std=0.02, norm_std=0.1, **settings)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
    if fast:
        apply_fast_paths(model, FastPathConfig(), "cpu")
    return model.eval()


def cut(rows, eos, pad=0):
    out = []
    for row in rows:
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end] or [pad])
    return out


def both(model, group, new, temperature, top_p, eos, greedy=False, seed=3):
    """(our loop's completions, generate's), each from the same seed."""
    with torch.no_grad():
        torch.manual_seed(seed)
        ours = sample_completions(model, PROMPTS, group, new, temperature, top_p, eos, 0, "cpu", greedy)
        torch.manual_seed(seed)
        ref = generate_completions(model, PROMPTS, group, new, temperature, top_p, eos, 0, "cpu", greedy)
    return ours, cut(ref, eos)


def sampling_report(model, group, new):
    """What GRPO's sampler reports for PROMPTS (report["generate"]: None when the loop ran, else
    the refusal counted as fallback:decode_loop)."""
    report = {}
    with torch.no_grad():
        sample_completions(model, PROMPTS, group, new, 1.0, 1.0, {10**6}, 0, "cpu", report=report)
    return report


@pytest.mark.parametrize("fast", [True, False], ids=["patched", "stock"])
@pytest.mark.parametrize("model_type", sorted(decoding.DECODE_ARCHS))
def test_sampled_and_greedy_completions_equal_generates_for_a_seed(model_type, fast):
    model = patched(model_type, fast=fast)
    assert decoding.decode_refusal(model, 64) is None  # the loop runs, not the fallback
    eos = {10**6}  # no end: every row runs to max_new_tokens
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        ours, ref = both(model, 4, 20, temperature, top_p, eos)
        assert ours == ref, (temperature, top_p)
        assert len({tuple(c) for c in ours}) > len(PROMPTS)  # a group's samples differ
    ours, ref = both(model, 1, 20, 1.0, 1.0, eos, greedy=True)
    assert ours == ref


def test_rows_end_at_their_first_end_token_as_with_generate():
    model = patched()
    with torch.no_grad():
        torch.manual_seed(3)
        free = generate_completions(model, PROMPTS, 4, 20, 1.0, 1.0, {10**6}, 0, "cpu")
    # End tokens that occur early in some rows and not in others.
    eos = {free[0][2], free[5][4]}
    ours, ref = both(model, 4, 20, 1.0, 1.0, eos)
    assert ours == ref
    lengths = {len(c) for c in ours}
    assert min(lengths) < 20 and max(lengths) == 20


def test_the_loop_stops_at_its_next_check_once_every_row_has_ended(monkeypatch):
    model = patched()
    vocab = model.get_input_embeddings().weight.shape[0]
    eos = set(range(vocab))  # every first token ends its row
    forwards = []
    logits = decoding._logits
    monkeypatch.setattr(decoding, "_logits", lambda *a: forwards.append(1) or logits(*a))
    with torch.no_grad():
        torch.manual_seed(3)
        rows = decoding.decode(model, PROMPTS, 2, 40, 1.0, 1.0, eos, 0, "cpu")
    assert len(forwards) == decoding.STOP_CHECK_EVERY  # the prompt's and 7 steps' (not 40)
    assert all(len(r) == 1 for r in rows)  # generate's length: up to the step the last row ended


@pytest.mark.parametrize("vocab_share", [1, 2])
def test_after_an_early_end_the_rng_moves_on_as_after_generate(vocab_share):
    """The draws made between the last row's end and the stop check are taken back: the
    completions and the next random numbers equal generate's, so a run's later steps do too."""
    model = patched()
    vocab = model.get_input_embeddings().weight.shape[0]
    eos = set(range(0, vocab, vocab_share))  # every token, or every other one, ends a row
    with torch.no_grad():
        outs = []
        for fn in (sample_completions, generate_completions):
            torch.manual_seed(5)
            first = fn(model, PROMPTS, 4, 30, 1.0, 1.0, eos, 0, "cpu")
            second = fn(model, PROMPTS, 4, 30, 1.0, 1.0, eos, 0, "cpu")
            outs.append((cut(first, eos), cut(second, eos), torch.rand(4)))
    (a1, a2, ar), (b1, b2, br) = outs
    assert a1 == b1 and a2 == b2
    assert torch.equal(ar, br)
    if vocab_share == 2:
        assert max(map(len, a1)) > 1  # rows ended at different steps


@pytest.mark.parametrize("fast", [True, False], ids=["patched", "stock"])
def test_smollm3s_nope_layer_skips_the_rotation_and_the_comparison_sees_it(fast, monkeypatch):
    """The tiny SmolLM3 has a NoPE layer (Arch.uses_rope False), so the comparison with generate
    above covers it: the loop's plans say so, and a loop that rotated it anyway would differ."""
    model = patched("smollm3", fast=fast)
    net = decoding._Layers(model)
    assert [p.use_rope for p in net.attn_plans] == [True, False]
    with torch.no_grad():  # sharp attention in the NoPE layer, so that a rotation there shows
        for proj in (net.layers[1].self_attn.q_proj, net.layers[1].self_attn.k_proj):
            proj.base_layer.weight.mul_(8.0)
    eos = {10**6}
    ours, ref = both(model, 2, 12, 1.0, 1.0, eos)
    assert ours == ref
    rotate = decoding._attention
    monkeypatch.setattr(
        decoding, "_attention", lambda a, p, h, cos, sin, _, *rest: rotate(a, p, h, cos, sin, True, *rest)
    )
    rotated, _ = both(model, 2, 12, 1.0, 1.0, eos)
    assert rotated != ref


def test_the_comparison_sees_gemma2s_softcaps(monkeypatch):
    """Gemma-2's attention-logit and head softcaps (2.0 each), with sharp attention and logits so
    that they bite: the loop caps as the stock forward does; without either cap it would differ."""
    model = patched("gemma2", attn_logit_softcapping=2.0, final_logit_softcapping=2.0)
    net = decoding._Layers(model)
    with torch.no_grad():
        for layer in net.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.base_layer.weight.mul_(8.0)
        net.hf.lm_head.weight.mul_(30.0)  # tied: the embeddings too, which the norms take back out
    eos = {10**6}
    ours, ref = both(model, 4, 20, 1.0, 1.0, eos)
    assert ours == ref
    real = decoding._Layers.__init__
    for name, uncapped in (("softcaps", [None] * len(net.layers)), ("final_softcap", None)):

        def without(self, model, name=name, uncapped=uncapped):
            real(self, model)
            setattr(self, name, uncapped)

        monkeypatch.setattr(decoding._Layers, "__init__", without)
        differs, _ = both(model, 4, 20, 1.0, 1.0, eos)
        assert differs != ref, name
        monkeypatch.setattr(decoding._Layers, "__init__", real)


@pytest.mark.parametrize("model_type", ["cohere"])
def test_a_model_the_loop_refuses_samples_through_generate(model_type):
    model = patched(model_type, attn="eager")
    assert model_type in decoding.decode_refusal(model, 64)
    ours, ref = both(model, 2, 8, 1.0, 1.0, {10**6})
    assert ours == ref
    report = sampling_report(model, 2, 4)
    assert report["generate"] == f"model_type {model_type!r} is not one the decode loop repeats"


def rope_that_grows(rope_type, original):
    """A tiny Llama whose rotary tables change once a sequence passes `original` tokens."""
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":  # attention_factor != 1, so the tables' scale is compared too
        rope.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=original)
        return patched("llama", rope_parameters=rope)
    return patched("llama", rope_parameters=rope, max_position_embeddings=original)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rotary_tables_that_grow_are_repeated_up_to_the_length_where_they_change(rope_type):
    """PROMPTS plus 8 new tokens reach 19: inside 32 the loop samples as generate does (its
    tables are the original ones); past 16 it refuses and generate samples."""
    model = rope_that_grows(rope_type, 32)
    assert decoding.decode_refusal(model, 32) is None
    ours, ref = both(model, 2, 8, 1.0, 1.0, {10**6})
    assert ours == ref
    report = sampling_report(model, 2, 8)
    assert report["generate"] is None  # the loop ran, no fallback

    model = rope_that_grows(rope_type, 16)
    assert decoding.decode_refusal(model, 19) == (
        f"its rotary tables change with the sequence length (rope_type {rope_type!r}) past 16 tokens"
    )
    assert decoding.decode_refusal(model, 16) is None
    ours, ref = both(model, 2, 8, 1.0, 1.0, {10**6})
    assert ours == ref
    report = sampling_report(model, 1, 8)
    assert "rotary tables" in report["generate"]


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss", "phi3"])
def test_the_comparison_sees_the_loops_sliding_windows(model_type, monkeypatch):
    """Windows of 8 tokens over sequences of up to 31: the loop's band equals generate's sliding
    mask (above), and a loop that read the whole cache would differ."""
    model = patched(model_type)
    assert 8 in decoding._Layers(model).windows
    eos = {10**6}
    ours, ref = both(model, 2, 16, 1.0, 1.0, eos)
    assert ours == ref
    monkeypatch.setattr(decoding, "_windowed", lambda mask, at, window: mask)
    unbanded, _ = both(model, 2, 16, 1.0, 1.0, eos)
    assert unbanded != ref


def test_the_comparison_sees_phi3s_partial_rotation(monkeypatch):
    """Phi-3's table covers half of each head here: the loop rotates those dims and passes the
    rest; reading it as GPT-OSS's half-width table (each half rotated) would sample otherwise."""
    model = patched("phi3")
    assert decoding.decode_refusal(model, 64) is None
    eos = {10**6}
    ours, ref = both(model, 4, 20, 1.0, 1.0, eos)
    assert ours == ref
    monkeypatch.setattr(decoding, "HALF_WIDTH_ROPE", frozenset({"gpt_oss", "phi3"}))
    halves, _ = both(model, 4, 20, 1.0, 1.0, eos)
    assert halves != ref


def test_phi4_minis_longrope_with_partial_rotation_samples_as_generate():
    """Phi-4-mini's shape: longrope tables over 3/4 of each head, inside the original length."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    rope.update(short_factor=[1.0] * 6, long_factor=[2.0] * 6, original_max_position_embeddings=32)
    model = patched("phi3", rope_parameters=rope, max_position_embeddings=128)
    assert decoding.decode_refusal(model, 32) is None
    ours, ref = both(model, 2, 8, 1.0, 1.0, {10**6})
    assert ours == ref


def test_the_comparison_sees_gemma3s_rotary_table_per_layer_type(monkeypatch):
    """Gemma-3's sliding layers rotate with their own base frequency (10,000 against 1,000,000):
    the loop reads each layer's table; one table for every layer would sample otherwise."""
    model = patched("gemma3_text")
    assert decoding._Layers(model).rope_keys == ["sliding_attention", "full_attention"]
    eos = {10**6}
    ours, ref = both(model, 2, 16, 1.0, 1.0, eos)
    assert ours == ref
    real = decoding._Layers.__init__

    def one_table(self, model):
        real(self, model)
        self.rope_keys = [self.rope_keys[-1]] * len(self.rope_keys)

    monkeypatch.setattr(decoding._Layers, "__init__", one_table)
    shared, _ = both(model, 2, 16, 1.0, 1.0, eos)
    assert shared != ref


def test_the_comparison_sees_gpt_oss_sinks(monkeypatch):
    """GPT-OSS's sinks take part in the loop's softmax as in transformers' eager attention; the
    loop taken with them left out (plain softmax attention) would sample otherwise."""
    model = patched("gpt_oss")
    eos = {10**6}
    ours, ref = both(model, 2, 16, 1.0, 1.0, eos)
    assert ours == ref
    monkeypatch.setattr(
        decoding,
        "_sink_attention",
        lambda attn, qg, keys, values, mask, t: F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=mask, scale=attn.scaling
        ),
    )
    sinkless, _ = both(model, 2, 16, 1.0, 1.0, eos)
    assert sinkless != ref


def test_no_host_read_back_per_token(monkeypatch):
    """Every way a tensor's value reaches the host (a device sync on a GPU), counted over one
    call: the stop checks (one every STOP_CHECK_EVERY steps) and the final copy only."""
    model = patched()
    calls = collections.Counter()
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            calls[_name] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = 32
    with torch.no_grad():
        decoding.decode(model, PROMPTS, 4, steps, 0.8, 0.9, {10**6}, 0, "cpu")
    checks = (steps - 1) // decoding.STOP_CHECK_EVERY
    assert sum(calls.values()) <= checks + 1, dict(calls)
    assert calls["tolist"] == 1


def test_a_decoding_step_runs_fewer_ops_than_generates():
    from torch.profiler import ProfilerActivity, profile

    model = patched()

    def ops_per_step(fn, steps):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(model, PROMPTS, 4, steps, 1.0, 1.0, {10**6}, 0, "cpu")
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    # The difference of two lengths: the per-step ops, without the prompt's pass.
    ours = (ops_per_step(sample_completions, 24) - ops_per_step(sample_completions, 8)) / 16
    ref = (ops_per_step(generate_completions, 24) - ops_per_step(generate_completions, 8)) / 16
    assert ours < 0.85 * ref, (ours, ref)


def test_with_packed_attention_on_no_prompt_reads_its_padding():
    """The session runs with packed attention, which sees no padding mask: generate is switched
    off it for the call (and back after), and the loop builds its own mask; both give each
    prompt's greedy answer as it gets alone."""
    from engine.fastpath.attention import ATTN_NAME, enable_packed_attention

    model = patched("llama")
    assert enable_packed_attention(model) == "on"
    eos = {10**6}
    with torch.no_grad():
        alone = [generate_completions(model, [p], 1, 12, 1.0, 1.0, eos, 0, "cpu", True)[0] for p in PROMPTS]
        batched = generate_completions(model, PROMPTS, 1, 12, 1.0, 1.0, eos, 0, "cpu", True)
        ours = sample_completions(model, PROMPTS, 1, 12, 1.0, 1.0, eos, 0, "cpu", True)
    assert batched == alone and ours == alone
    assert model.config._attn_implementation == ATTN_NAME


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_with_the_triton_kernels_the_loop_equals_generate(model_type):
    """The GPU's layer: Triton RMSNorm, add+RMSNorm and RoPE (in place, on private copies of q
    and k) through the interpreter, in the loop as in the training forward."""
    model = tiny_model(model_type, lora={}, lora_b_std=0.02, norm_std=0.1)
    assert set(apply_fast_paths(model, FastPathConfig(), "cpu", kernel_impl="triton").values()) == {"on"}
    model.eval()
    assert decoding.decode_refusal(model, 64) is None
    ours, ref = both(model, 4, 10, 0.7, 0.9, {10**6})
    assert ours == ref
    ours, ref = both(model, 1, 10, 1.0, 1.0, {10**6}, greedy=True)
    assert ours == ref
