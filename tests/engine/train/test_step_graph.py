"""CUDA graphs over SFT micro-batches (engine.train.step_graph), the parts that hold on any CPU:
the buckets a micro-batch maps to, the static batch a bucket fills (padding document, empty
trailing documents, padded block tables) giving the same loss and gradients as the batch itself,
and the choice with its reasons. Capture and replay are tested on the GPU
(tests/gpu/test_step_graph_gpu.py)."""

import pytest
import torch

from engine.config import FastPathConfig
from engine.data.collate import PackedBatch
from engine.kernels.varlen_attention import TABLE_BLOCKS, host_block_table
from engine.train.step import forward_loss, prepare_model
from engine.train.step_graph import (
    MIN_DOC_BUCKET,
    STATIC_BLOCKS,
    StepGraphs,
    _Bucket,
    bucket_docs,
    bucket_tokens,
    graph_choice,
)
from tests.tiny_models import tiny_model


@pytest.mark.parametrize(
    ("n", "bucket"),
    [(1, 64), (64, 64), (65, 128), (1000, 1024), (16384, 16384), (16385, 18432), (30000, 30720)],
)
def test_token_buckets_round_up_by_at_most_an_eighth(n, bucket):
    assert bucket_tokens(n) == bucket
    assert bucket - n <= max(64, n // 8)


def test_document_buckets_are_powers_of_two():
    assert [bucket_docs(n) for n in (1, 8, 9, 64, 65)] == [MIN_DOC_BUCKET, 8, 16, 64, 128]


def _batch(lengths, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    trained = [[t > 1 for t in range(n)] for n in lengths]  # a prompt of two tokens each
    return PackedBatch.from_documents(docs, trained)


def test_a_filled_bucket_holds_the_batch_then_padding_then_empty_documents():
    batch = _batch([5, 9, 3])
    key = StepGraphs.key(batch)
    assert key == (64, MIN_DOC_BUCKET, False)  # 17 tokens -> 64, 3 documents + padding -> 8
    b = _Bucket(key, torch.device("cpu"))
    b.fill(batch)
    ids, targets, info = b.batch.input_ids[0], b.batch.targets[0], b.batch.info
    assert torch.equal(ids[:17], batch.input_ids[0]) and not ids[17:].any()
    assert torch.equal(targets[:17], batch.targets[0]) and (targets[17:] == -100).all()
    assert info.cu_seqlens.tolist() == [0, 5, 14, 17, 64, 64, 64, 64, 64]
    assert info.position_ids[17:].tolist() == list(range(47))
    for (kind, block), rows in b.table_shapes:
        table, n = info.block_table(kind, block)
        assert n == rows == -(-64 // block) + MIN_DOC_BUCKET
        real = host_block_table([5, 9, 3, 47], block, kind)
        assert torch.equal(table[: real.shape[0]], real)
        assert (table[real.shape[0] :, 0] == -1).all()
    blocks = set(TABLE_BLOCKS) | set(STATIC_BLOCKS)
    assert {k for k, _ in b.table_shapes} == {(kind, blk) for blk in blocks for kind in ("q", "k")}
    with pytest.raises(RuntimeError, match="no attention table"):  # never one built from other lengths
        info.block_table("q", 8)


def test_refilling_a_bucket_leaves_nothing_of_the_batch_before():
    first, second = _batch([30, 20], seed=1), _batch([10, 10, 10, 12], seed=2)
    assert StepGraphs.key(first) == StepGraphs.key(second)
    b = _Bucket(StepGraphs.key(first), torch.device("cpu"))
    b.fill(first)
    b.fill(second)
    fresh = _Bucket(StepGraphs.key(second), torch.device("cpu"))
    fresh.fill(second)
    assert torch.equal(b.wide, fresh.wide) and torch.equal(b.narrow, fresh.narrow)


@pytest.mark.parametrize(("family", "backend"), [("qwen3", None), ("llama", None), ("qwen3", "triton")])
def test_the_bucket_batch_gives_the_batch_own_loss_and_gradients(family, backend):
    """What a graph replays (normalizer 1, times 1/normalizer) against the eager micro-batch; with
    the Triton attention (the interpreter here) its block tables are the bucket's static ones."""
    from engine.fastpath.attention import enable_packed_attention

    torch.manual_seed(0)
    model = tiny_model(family, lora={}, lora_b_std=0.02)
    prepared = prepare_model(model, FastPathConfig(), torch.device("cpu"), True)
    if backend is not None:
        assert enable_packed_attention(model, backend=backend) == "on"
    model.train()
    batch = _batch([7, 12, 4, 9], vocab=model.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(b, normalizer):
        loss = forward_loss(prepared, b, normalizer)
        loss.backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return loss.detach(), grads

    eager_loss, eager_grads = run(batch, batch.num_trained_tokens)
    bucket = _Bucket(StepGraphs.key(batch), torch.device("cpu"))
    bucket.fill(batch)
    inv = torch.tensor(1.0 / batch.num_trained_tokens)
    loss, grads = run(bucket.batch, 1.0)
    if backend == "triton":  # the kernels read the bucket's tables (those a replay refills)
        assert bucket.info.requested
    # The graph's loss: the sum times 1/normalizer (engine.train.step_graph._capture).
    torch.testing.assert_close(loss * inv, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g * inv, e, rtol=1e-4, atol=1e-6)


def _choice(**over):
    model = tiny_model("llama", lora={})
    prepared = prepare_model(model, FastPathConfig(), torch.device("cpu"), True)
    args = dict(device="cuda", objective="sft", distributed=False, prepared=prepared, model=model, lora_dropout=0.0)
    args.update(over)
    return graph_choice(over.pop("setting", "auto"), **{k: v for k, v in args.items() if k != "setting"})


def test_auto_is_on_for_a_small_sft_run_on_cuda():
    on, why = _choice()
    assert on and why.startswith("auto: hidden size")


@pytest.mark.parametrize(
    ("over", "words"),
    [
        (dict(setting=False), "disabled in config"),
        (dict(device="cpu"), "CUDA GPU"),
        (dict(objective="dpo"), "dpo"),
        (dict(distributed=True), "several processes"),
        (dict(lora_dropout=0.05), "dropout"),
        (dict(memory=8 * 2**30), "8.0 GiB on the card"),  # a laptop's card: auto leaves the pool's room
        (dict(setting=True, memory=8 * 2**30, objective="kto"), "kto"),
    ],
)
def test_each_reason_it_stays_off(over, words):
    on, why = _choice(**over)
    assert not on and words in why


def test_metadata_rebuilt_in_every_layer_stays_off_the_graphs():
    # Seen on the H200 (learning tier, qwen3-cached_metadata=False): each layer copied host lengths to
    # the device inside the capture, which failed and was counted as a fallback on every step.
    model = tiny_model("llama", lora={})
    prepared = prepare_model(model, FastPathConfig(cached_metadata=False), torch.device("cpu"), True)
    on, why = graph_choice(
        True, device="cuda", objective="sft", distributed=False, prepared=prepared, model=model, lora_dropout=0.0
    )
    assert not on and "cached_metadata off" in why


def test_offload_goes_into_the_graph_and_keeps_no_rng_state_without_dropout():
    """The offloader's copies are captured with the layers; a capture cannot read the RNG state,
    which only a model that draws random numbers needs kept."""
    model = tiny_model("llama", lora={})
    prepared = prepare_model(model, FastPathConfig(), torch.device("cpu"), True, offload="single")
    on, why = graph_choice(
        True, device="cuda", objective="sft", distributed=False, prepared=prepared, model=model, lora_dropout=0.0
    )
    assert on, why
    assert prepared.offloader.keep_rng is False
    dropped = tiny_model("llama", lora={"lora_dropout": 0.1})
    assert prepare_model(dropped, FastPathConfig(), torch.device("cpu"), True, offload="single").offloader.keep_rng


def test_checkpointing_keeps_no_rng_state_without_dropout():
    """A capture cannot read the device's RNG state; without dropout there is nothing to keep."""
    from engine.train.step import draws_random

    model = tiny_model("llama", lora={})
    assert not draws_random(model.base_model.model)
    dropped = tiny_model("llama", lora={"lora_dropout": 0.1})
    assert draws_random(dropped.base_model.model)


def test_a_micro_batch_that_could_not_replay_is_named_to_the_monitor():
    from engine.counters import requested_but_not_run

    report = {"cuda_graphs": "on: auto: hidden size 1,024, launch-bound"}
    assert requested_but_not_run(report, {}, {}) == {}
    fallbacks = {"cuda_graphs: capture failed (RuntimeError: x)": 3}
    assert requested_but_not_run(report, {}, fallbacks) == {
        "cuda_graphs": "fell back: capture failed (RuntimeError: x) (3x)"
    }


def test_a_set_value_takes_graphs_on_a_small_card():
    on, why = _choice(setting=True, memory=8 * 2**30)
    assert on and why == "set in config"


def test_prepared_models_skip_transformers_padding_check(monkeypatch):
    """GPT-2 (like some sixty families) runs transformers' padding warning in every forward, which
    copies a CPU index to the ids' device: a CUDA graph's capture refused it and the step fell back
    (seen on the H100). A prepared model never calls it; an unprepared one does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

    calls = []
    monkeypatch.setattr(PreTrainedModel, "warn_if_padding_and_no_attention_mask", lambda self, *a: calls.append(1))
    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64, pad_token_id=0)

    def model():
        torch.manual_seed(0)
        return get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules=["c_attn"]))

    ids = torch.tensor([[0, 5, 6, 7, 0]])
    model()(input_ids=ids)
    assert calls, "transformers no longer runs the check: the engine's stand-in can go"
    calls.clear()
    prepared = prepare_model(model(), FastPathConfig(), torch.device("cpu"), False)
    prepared.model(input_ids=ids)
    assert calls == []


def test_a_failed_capture_names_the_model_code_that_stopped_it():
    # The counted reason names the innermost frame outside torch: here a model file under
    # site-packages whose op (a torch call) raised, as a capture's refused host copy does.
    from engine.train.step_graph import failed_at

    source = "def forward(x):\n    return torch.zeros(2).to(x)\n"
    scope = {"torch": torch}
    exec(compile(source, "/env/lib/site-packages/transformers/models/gpt2/modeling_gpt2.py", "exec"), scope)
    with pytest.raises(TypeError) as info:
        scope["forward"](object())
    assert failed_at(info.value) == " at transformers/models/gpt2/modeling_gpt2.py:2"
    assert failed_at(RuntimeError("no traceback")) == ""


NOTICE = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"


def test_a_read_back_during_capture_is_named_by_the_code_that_made_it():
    # torch's sync debug mode warns from the op's own call; the watch keeps the first such
    # warning's place (the model file here) and lets every other warning through.
    import warnings

    from engine.train.step_graph import SyncWatch

    source = (
        "import warnings\n"
        "def forward(x):\n"
        "    warnings.warn('called a synchronizing CUDA operation (Triggered internally at c10/cuda/x.cpp:1.)')\n"
        "    warnings.warn('called a synchronizing CUDA operation')\n"
        "    return x\n"
    )
    scope: dict = {}
    exec(compile(source, "/env/lib/site-packages/transformers/models/longcat_flash/modeling.py", "exec"), scope)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with SyncWatch() as watch:
            # torch's one-time notice when the mode is first set (seen as the place on an H100): not
            # a read back, so it passes through and names nothing.
            warnings.warn(NOTICE)
            scope["forward"](1)
            warnings.warn("something else")
    assert watch.place == " at transformers/models/longcat_flash/modeling.py:3"
    assert [str(w.message) for w in seen] == [NOTICE, "something else"]
    assert SyncWatch().place == ""
