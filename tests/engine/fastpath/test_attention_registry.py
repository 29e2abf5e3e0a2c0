"""The "tunesmith_varlen" transformers attention: registration, switching models, and parity.

A tiny Llama / Qwen3 built from a config (random weights) run on one packed row must give the
same loss and gradients as running its documents one by one, unpacked, with stock SDPA.
"""

import inspect

import peft
import pytest
import torch

from engine.fastpath import packed
from engine.fastpath.attention import ATTN_NAME, disable_packed_attention, enable_packed_attention, varlen_attention
from engine.fastpath.packed import PackedSeqInfo
from engine.kernels.varlen_attention import varlen_attention_reference
from tests.tiny_models import tiny_model

LENGTHS = [5, 1, 12, 9]


def _tiny(kind, attn="sdpa"):
    return tiny_model(kind, attn=attn, vocab_size=97, max_position_embeddings=128)


def _doc_loss(logits, ids):
    # Next-token loss inside one document, summed (a document's last token has no target).
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[1:], reduction="sum")


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_run(model, ids, info):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids[None], use_cache=False, **info.model_kwargs())
    loss = sum(
        _doc_loss(out.logits[:, s:e], ids[s:e])
        for s, e in zip(info.cu_seqlens[:-1].tolist(), info.cu_seqlens[1:].tolist())
    )
    loss.backward()
    return loss.detach(), _grads(model)


def _unpacked_run(model, ids, info):
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for s, e in zip(info.cu_seqlens[:-1].tolist(), info.cu_seqlens[1:].tolist()):
        out = model(input_ids=ids[None, s:e], use_cache=False)
        loss = loss + _doc_loss(out.logits, ids[s:e])
    loss.backward()
    return loss.detach(), _grads(model)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_same(a, b, tol):
    """Loss and every gradient within `tol` of the reference relative to its norm: packed and
    unpacked sum the documents' gradients in another order, so single elements near zero
    differ by rounding that depends on the CPU's BLAS; a wrong mask or position is off by
    O(1) relative."""
    (la, ga), (lb, gb) = a, b
    assert _rel(la, lb) <= tol, (la, lb)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert ga[name].shape == gb[name].shape, name
        assert _rel(ga[name], gb[name]) <= tol, (name, _rel(ga[name], gb[name]))


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_matches_unpacked(kind, backend):
    model = _tiny(kind)
    info = PackedSeqInfo.from_lengths(LENGTHS)
    ids = torch.randint(0, 97, (info.total_tokens,), generator=torch.Generator().manual_seed(1))
    want = _unpacked_run(model, ids, info)
    assert enable_packed_attention(model, backend=backend) == "on"
    assert model.config._attn_implementation == ATTN_NAME
    packed.reset_counters()
    got = _packed_run(model, ids, info)
    # Cached metadata: the layers built nothing. The Triton kernel never reads the device; the
    # reference (the CPU path) reads cu_seqlens once per layer, and says so. (Uncounted reads
    # are caught by the sniffer in tests/engine/fastpath/test_fastpath_counters.py.)
    counts = packed.reset_counters()
    layers = model.config.num_hidden_layers
    if backend == "triton":
        assert counts == {"metadata_builds": 0, "host_syncs": 0, "moe_calls": 0, "attention:varlen_triton": layers}
    else:
        assert counts == {"metadata_builds": 0, "host_syncs": layers, "moe_calls": 0, "attention:reference": layers}
    _assert_same(got, want, 2e-4 if backend == "triton" else 1e-5)
    # Without packing metadata the same row would attend across documents: the test can fail.
    model.zero_grad(set_to_none=True)
    cross = model(input_ids=ids[None], use_cache=False).logits
    plain = model(input_ids=ids[None], use_cache=False, **info.model_kwargs()).logits
    assert (cross - plain).abs().max() > 1e-3


def test_rebuilt_per_layer_ablation_counts_builds():
    model = _tiny("qwen3")
    info = PackedSeqInfo.from_lengths(LENGTHS)
    ids = torch.randint(0, 97, (info.total_tokens,), generator=torch.Generator().manual_seed(2))
    want = _unpacked_run(model, ids, info)
    assert enable_packed_attention(model, cached_metadata=False) == "on"
    packed.reset_counters()
    got = _packed_run(model, ids, info)
    # One rebuild from position_ids per layer, each reading the positions on the host (and
    # the reference attention reading cu_seqlens).
    counts = packed.reset_counters()
    layers = model.config.num_hidden_layers
    assert counts["metadata_builds"] == layers
    assert counts["host_syncs"] == layers + counts["attention:reference"] == 2 * layers
    _assert_same(got, want, 1e-5)


def test_position_ids_only_and_no_kwargs():
    model = _tiny("llama")
    info = PackedSeqInfo.from_lengths(LENGTHS)
    ids = torch.randint(0, 97, (info.total_tokens,), generator=torch.Generator().manual_seed(3))
    assert enable_packed_attention(model) == "on"
    with torch.no_grad():
        full = model(input_ids=ids[None], use_cache=False, **info.model_kwargs()).logits
        by_pos = model(input_ids=ids[None], use_cache=False, position_ids=info.position_ids[None]).logits
        torch.testing.assert_close(by_pos, full)
        # No metadata at all: each row is one document, as stock causal attention would do.
        rows = ids[:12].view(2, 6)
        ours = model(input_ids=rows, use_cache=False).logits
        disable_packed_attention(model)
        assert model.config._attn_implementation == "sdpa"
        stock = model(input_ids=rows, use_cache=False).logits
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)


def test_a_layer_given_only_the_batchs_positions_finds_its_metadata():
    # StableLM's and Nemotron's decoder layers (transformers 5.17) take the packing kwargs but hand
    # their attention only position_ids: the batch's own positions lead to its metadata with no
    # read back, where a copy of the same values is rebuilt from the device in every layer.
    model = _tiny("llama")
    info = PackedSeqInfo.from_lengths(LENGTHS)
    ids = torch.randint(0, 97, (info.total_tokens,), generator=torch.Generator().manual_seed(3))
    assert enable_packed_attention(model) == "on"
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        full = model(input_ids=ids[None], use_cache=False, **info.model_kwargs()).logits
        packed.reset_counters()
        own = model(input_ids=ids[None], use_cache=False, position_ids=info.position_ids[None]).logits
        assert packed.reset_counters()["metadata_builds"] == 0
        copied = model(input_ids=ids[None], use_cache=False, position_ids=info.position_ids[None].clone()).logits
        assert packed.reset_counters()["metadata_builds"] == layers
    torch.testing.assert_close(own, full)
    torch.testing.assert_close(copied, full)
    assert packed.lookup_positions(info.position_ids[None]) is info
    assert packed.lookup_positions(info.position_ids[:5]) is None  # a part is not the batch's positions


def test_generation_with_cache_matches_sdpa():
    model = _tiny("qwen3").eval()
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert enable_packed_attention(model) == "on"
        got = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_peft_wrapped_model_and_no_dense_mask():
    from transformers import masking_utils

    model = _tiny("qwen3")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert enable_packed_attention(model) == "on"
    base = model.get_base_model()
    assert base.config._attn_implementation == ATTN_NAME
    # transformers builds no [T x T] mask (and does not scan position_ids) for this implementation.
    info = PackedSeqInfo.from_lengths(LENGTHS)
    embeds = torch.zeros(1, info.total_tokens, 64)
    # The cache argument was renamed across transformers 5.x; cache_position existed in older ones.
    params = inspect.signature(masking_utils.create_causal_mask).parameters
    extra = {"cache" if "cache" in params else "past_key_values": None}
    if "cache_position" in params:
        extra["cache_position"] = torch.arange(info.total_tokens)
    mask = masking_utils.create_causal_mask(
        config=base.config, inputs_embeds=embeds, attention_mask=None, position_ids=info.position_ids[None], **extra
    )
    assert mask is None
    ids = torch.randint(0, 97, (1, info.total_tokens))
    out = model(input_ids=ids, use_cache=False, **info.model_kwargs())
    out.logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_refusals_leave_model_alone():
    model = _tiny("llama")
    model.config.attention_dropout = 0.1
    assert enable_packed_attention(model).startswith("off:")
    assert model.config._attn_implementation == "sdpa"
    assert enable_packed_attention(torch.nn.Linear(2, 2)).startswith("off:")


def test_varlen_attention_dispatch_cpu_is_reference():
    info = PackedSeqInfo.from_lengths([3, 8])
    q, k, v = torch.randn(11, 4, 16), torch.randn(11, 2, 16), torch.randn(11, 2, 16)
    out = varlen_attention(q, k, v, info.cu_seqlens, info.max_seqlen, sliding_window=4, softcap=3.0)
    ref = varlen_attention_reference(q, k, v, info.cu_seqlens, sliding_window=4, softcap=3.0)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, v, info.cu_seqlens, info.max_seqlen, backend="nope")


def test_torch_flash_backend_is_cuda_only():
    from engine.fastpath.attention import backend_available, varlen_attention

    q = torch.randn(8, 2, 16)
    assert not backend_available("torch_flash", q) and not backend_available("triton", q)
    assert backend_available("reference", q)
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention(q, q, q, torch.tensor([0, 8], dtype=torch.int32), 8, backend="torch_flash", softcap=5.0)


@pytest.mark.parametrize("d,dv", [(24, 16), (192, 128), (16, 16)], ids=["mla-tiny", "deepseek-v3", "plain"])
def test_the_triton_backend_pads_head_dims_it_does_not_tile(d, dv):
    # MLA's queries and keys are wider than its values and not a power of two (DeepSeek-V3: 192
    # against 128): the kernel runs them padded with zeros, with the unpadded scale, and the output
    # and gradients are the reference's (which takes the shapes as they are).
    from engine.counters import Counters
    from engine.fastpath.attention import kernel_head_dim, varlen_attention
    from engine.fastpath.packed import PackedSeqInfo

    info = PackedSeqInfo.from_lengths([9, 1, 14])
    t = info.total_tokens
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(t, h, w, generator=g) for h, w in ((4, d), (2, d), (2, dv), (4, dv)))
    grads = []
    counters = Counters()
    for backend in ("triton", "reference"):
        x = [a.clone().requires_grad_() for a in (q, k, v)]
        with counters.active():
            out = varlen_attention(*x, info.cu_seqlens, info.max_seqlen, backend=backend, info=info)
        assert out.shape == (t, 4, dv)
        out.backward(do)
        grads.append([out] + [a.grad for a in x])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    padded = kernel_head_dim(d, dv) != d or d != dv
    assert (counters["attention:padded_head_dim"] > 0) == padded
    assert kernel_head_dim(192, 128) == 256 and kernel_head_dim(8, 8) == 16 and kernel_head_dim(320, 256) == 512
    assert kernel_head_dim(512, 512) == 512 and kernel_head_dim(576, 512) is None


def test_a_packed_rows_gradients_flow_back_to_the_projections_uncopied():
    """B == 1: q/k/v reach the kernel as views, and their gradients come back as views too (no
    select backward, which zero-fills a whole gradient and copies into it), so the projections'
    [T, H*D] gradients are the attention's own dQ/dK/dV memory."""
    from engine.fastpath.attention import tunesmith_varlen_attention_forward

    info = PackedSeqInfo.from_lengths([5, 7])
    t, hq, hk, d = 12, 4, 2, 16
    proj_q = torch.randn(1, t, hq * d, requires_grad=True)
    proj_kv = torch.randn(1, t, 2 * hk * d, requires_grad=True)
    q = proj_q.view(1, t, hq, d).transpose(1, 2)  # what the patched attention hands over
    k, v = (x.view(1, t, hk, d).transpose(1, 2) for x in proj_kv.split(hk * d, -1))
    module = torch.nn.Module()
    out, _ = tunesmith_varlen_attention_forward(
        module, q, k, v, None, cu_seq_lens_q=info.cu_seqlens, max_length_q=info.max_seqlen, position_ids=None
    )
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        assert "Select" not in type(node).__name__, type(node).__name__
        stack.extend(fn for fn, _ in node.next_functions)
    out.sum().backward()
    ref = varlen_attention_reference(
        proj_q.detach().view(t, hq, d), *(x.view(t, hk, d) for x in proj_kv.detach().split(hk * d, -1)), info.cu_seqlens
    )
    torch.testing.assert_close(out.detach().view(t, hq, d), ref)
    assert proj_q.grad is not None and proj_kv.grad is not None
