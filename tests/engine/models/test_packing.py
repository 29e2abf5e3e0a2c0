"""Which families pack several documents into one row (engine.models.arch.packing), and that the
rest run each document alone with the stock model's loss.

Each family in PACKED_ROWS_CHECKED is checked here (or in test_more_families' table, which runs the
same comparison): a packed row of three documents through the engine (packed attention, patches,
fused loss) gives the loss of each document alone through the stock forward, to 1e-5, with nothing
counted as a fallback. Families seen to leak, and ones nobody checked, run each document alone and
say so; those whose logits the engine's loss would not see are found by the logits check
(engine.models.logits_check) before a step.
"""

from __future__ import annotations

import pytest
import torch
from test_more_families import FAMILIES, documents, engine_loss, stock_loss, tiny_family

from engine.counters import Counters, split_counts
from engine.models.arch import arch_for
from engine.models.arch.packing import PACKED_ROWS_CHECKED, STOCK_MASKS_MIX, documents_alone
from engine.models.logits_check import logits_mismatch, needs_check
from engine.train.step import decoder_and_head
from tests.tiny_models import tiny_config


def _wrapper(model_type: str) -> dict:
    """A multimodal wrapper's config values around its language model's tiny config (tests/tiny_models.py):
    its defaults alone make a full-size model (Gemma-3's: 2,304 wide, 26 layers, 262k vocabulary; 22 GB here)."""
    values = tiny_config(model_type).to_dict()
    values.pop("model_type", None)
    return values


# Tiny configs beyond TINY_BASE for checked families outside test_more_families' table:
# (extra values, TINY_BASE keys the config cannot take). Default: the family's Arch.tiny, or none.
_TINY = {
    "gemma3": (_wrapper("gemma3"), ()),
    "falcon": ({}, ("head_dim",)),  # FalconConfig derives head_dim
    "gptj": (dict(rotary_dim=8), ()),  # RoPE over part of each 16-wide head
    "codegen": (dict(rotary_dim=8), ()),
    # DBRX's sizes live in nested attention and FFN configs (its MoE: 4 experts, 2 a token).
    "dbrx": (
        dict(
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=256,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
        ),
        (),
    ),
    "dots1": (
        dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32)
        | dict(first_k_dense_replace=1, n_group=1, topk_group=1),
        (),
    ),
    # Gemma-3n's text model: the last two of four layers read the KV of earlier ones (KV sharing),
    # and a window of 8 tokens, shorter than the longest document, on the sliding layers.
    "gemma3n_text": (
        dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
        | dict(num_kv_shared_layers=2, sliding_window=8),
        (),
    ),
}


def _tiny(model_type: str, lora: bool = True):
    extra, without = _TINY.get(model_type, (None, ()))
    if extra is None:
        arch = arch_for(model_type)
        extra = dict(arch.tiny) if arch is not None and arch.tiny else {}
    return tiny_family(model_type, extra, lora=lora, without=without)


def _loss_and_fallbacks(model, docs, packed_attention=True) -> tuple[float, dict]:
    counters = Counters()
    with counters.active():
        loss = engine_loss(model, docs, packed_attention=packed_attention)
    return loss, split_counts(counters)[1]


def _family(model_type: str, lora: bool = True):
    if model_type in FAMILIES:
        return tiny_family(model_type, FAMILIES[model_type], lora=lora)
    return _tiny(model_type, lora=lora)


@pytest.mark.parametrize("model_type", sorted(PACKED_ROWS_CHECKED - set(FAMILIES)))
def test_a_checked_family_packs_a_row_with_the_stock_loss(model_type):
    _, model = _tiny(model_type)
    docs = documents()
    ref = stock_loss(model, docs)  # first: prepare_model switches the model's attention
    got, fallbacks = _loss_and_fallbacks(model, docs)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    assert not any("packed_rows" in key for key in fallbacks), fallbacks  # packed, not one by one
    assert not needs_check(model_type)


@pytest.mark.parametrize("model_type", sorted(PACKED_ROWS_CHECKED))
def test_a_checked_family_keeps_its_documents_apart_with_the_packed_attention_off(model_type):
    # fast_paths.packed_attention: false (or a model the packed attention refuses) leaves the
    # family's stock attention: its masks keep packed documents apart, or (STOCK_MASKS_MIX) the
    # documents run alone, saying why.
    _, model = _family(model_type)
    docs = documents()
    ref = stock_loss(model, docs)
    got, fallbacks = _loss_and_fallbacks(model, docs, packed_attention=False)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    said = [key for key in fallbacks if "packed_rows" in key]
    if model_type in STOCK_MASKS_MIX:
        assert said and "the engine's packed attention is off" in said[0], fallbacks
    else:
        assert not said, fallbacks


@pytest.mark.parametrize("model_type", sorted(STOCK_MASKS_MIX))
def test_the_stock_attention_of_a_mixing_family_would_let_packed_documents_see_each_other(model_type):
    # Why STOCK_MASKS_MIX exists: its stock attention on a packed row is not each document alone.
    from engine.data.collate import PackedBatch
    from engine.peft_model import hf_model

    _, model = _family(model_type, lora=False)
    docs = documents()
    batch = PackedBatch.from_documents(docs)
    decoder = decoder_and_head(model)[1]
    with torch.no_grad():
        hidden = decoder(**batch.model_kwargs(), use_cache=False).last_hidden_state
        alone = torch.cat([decoder(input_ids=torch.tensor([d])).last_hidden_state for d in docs], 1)
    assert hf_model(model).config._attn_implementation != "tunesmith_varlen"
    assert (hidden - alone).abs().max() > 1e-4


def test_the_family_table_is_checked_or_carries_state_along_a_row():
    # test_more_families checks each of its families on a packed row: a family there either packs
    # (then it must be in the list, or it would run one document at a time for nothing) or carries
    # state along a row.
    for model_type in FAMILIES:
        arch = arch_for(model_type)
        if arch is not None and arch.row_state:
            assert "carry state along a row" in documents_alone(model_type)
        else:
            assert model_type in PACKED_ROWS_CHECKED, model_type


# Families whose packed rows let a document see the one before it (seen here, before this list
# existed: engine loss 4.94 against the stock 4.95 for BLOOM, 4.85 against 4.86 for GPT-OSS), or
# whose stock code refuses a packed row (Qwen4-exp's gated delta rule without flash-linear-attention).
LEAKING = {
    "bloom": "ALiBi",
    "mpt": "not a family the engine has checked",
    "xglm": "not a family the engine has checked",
    "rwkv": "not a family the engine has checked",
    "qwen4_exp_text": "not a family the engine has checked",
}


@pytest.mark.parametrize("model_type", LEAKING)
def test_a_family_not_checked_runs_each_document_alone_with_the_stock_loss(model_type):
    _, model = _tiny(model_type)
    docs = documents()
    ref = stock_loss(model, docs)
    got, fallbacks = _loss_and_fallbacks(model, docs)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    said = [key for key in fallbacks if "packed_rows" in key]
    assert said and LEAKING[model_type] in said[0] and "each document runs alone" in said[0], fallbacks


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "qwen3_next"])
def test_a_row_of_one_document_runs_without_packed_metadata(model_type):
    # A family that runs each document alone gets positions only, a row of one document too: with
    # the packed metadata transformers 5.25's gated delta rule refuses the call without
    # flash-linear-attention (seen on a held-out eval batch of one document, after four steps that
    # trained). Nothing is counted: a row of one document loses nothing.
    if model_type not in LEAKING and not getattr(arch_for(model_type), "row_state", False):
        pytest.fail(f"{model_type} packs its rows: this test no longer covers the path it guards")
    _, model = _family(model_type)
    doc = documents()[:1]
    ref = stock_loss(model, doc)
    got, fallbacks = _loss_and_fallbacks(model, doc)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    assert not [key for key in fallbacks if "packed_rows" in key], fallbacks


def test_a_packed_row_of_a_leaking_family_would_differ():
    # What the list guards against: BLOOM packed (as before the list) is not the stock loss.
    from engine.data.collate import PackedBatch
    from engine.peft_model import hf_model

    _, model = _tiny("bloom", lora=False)
    docs = documents()
    batch = PackedBatch.from_documents(docs)
    decoder = hf_model(model).get_decoder()
    with torch.no_grad():
        hidden = decoder(**batch.model_kwargs(), use_cache=False).last_hidden_state
        alone = torch.cat([decoder(input_ids=torch.tensor([d])).last_hidden_state for d in docs], 1)
    assert (hidden - alone).abs().max() > 1e-3


def test_the_logits_check_passes_a_plain_head_and_refuses_what_it_cannot_see():
    for model_type in ("mpt", "xglm"):  # unchecked, a plain head: the check lets them train
        assert needs_check(model_type)
        assert logits_mismatch(*decoder_and_head(_tiny(model_type)[1])) is None
    # BERT's LM head transforms and norms the hidden state before its decoder matrix.
    why = logits_mismatch(*decoder_and_head(_tiny("bert")[1]))
    assert why.startswith("model_type 'bert': its own forward computes logits") and "differ by up to" in why
    # ELECTRA's generator projects to its embedding size first: the head cannot take the hidden state.
    why = logits_mismatch(*decoder_and_head(_tiny("electra")[1]))
    assert "model_type 'electra'" in why and "running this model that way failed" in why
    # Families with a file or in the list are not probed.
    assert not needs_check("llama") and not needs_check("cohere2_moe") and not needs_check("bloom")


def test_the_logits_check_leaves_the_model_as_it_was():
    _, model = _tiny("mpt")
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert logits_mismatch(*decoder_and_head(model)) is None
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_sparse_attention_indexer_keeps_its_stock_attention():
    # DeepSeek Sparse Attention picks each query's keys with an indexer and hands them to the
    # attention as a mask; the packed attention has no such selection, so it stays off (and the
    # family's stock masks keep the packed documents apart, as the checked-family test shows).
    from engine.fastpath.attention import enable_packed_attention

    _, model = _tiny("hy_v4")  # HunYuan-V4: attention sinks and an indexer
    said = enable_packed_attention(model)
    assert said.startswith("off:") and "sparse-attention indexer" in said, said
