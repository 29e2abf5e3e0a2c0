"""CUDA graphs over SFT micro-batches (engine.train.step_graph) on the GPU: a run whose
micro-batches replay graphs trains like the eager run, step for step, over many optimizer steps
(the adapters change under the graphs, so a stale cached weight would show), through two token
buckets and gradient accumulation; capture happens, replays happen, and a replay counts what the
eager forward counts. Also the session's path: a `TrainingSession` on CUDA reports the graphs."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _batches(vocab, seed=0):
    """Micro-batches of two token counts (two buckets) and varying document counts."""
    from engine.data.collate import PackedBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(24):
        total = 1000 if i % 3 else 700
        lengths, left = [], total
        while left > 0:
            n = min(left, int(torch.randint(16, 300, (1,), generator=g)))
            lengths.append(n)
            left -= n
        docs = [(torch.randint(0, vocab // 4, (n,), generator=g) * 3 % vocab).tolist() for n in lengths]
        out.append(PackedBatch.from_documents(docs, [[t > 2 for t in range(n)] for n in lengths]))
    return out


def _train(family, dtype, graphs_on: bool, accum=2, offload="off"):
    from engine.config import FastPathConfig
    from engine.counters import Counters
    from engine.train.optim import make_optimizer
    from engine.train.step import forward_loss, prepare_model
    from engine.train.step_graph import StepGraphs
    from tests.tiny_models import tiny_model

    device = torch.device("cuda")
    model = tiny_model(family, lora={}, lora_b_std=0.02, dtype=dtype, hidden_size=256, intermediate_size=512)
    model.to(device)
    prepared = prepare_model(model, FastPathConfig(), device, True, offload=offload)
    assert (prepared.offloader is not None) == (offload != "off")
    model.train()
    opt = make_optimizer(model, lr=2e-3, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    off = prepared.offloader
    graphs = None
    if graphs_on:
        version = (lambda: off.host_generation) if off is not None else (lambda: None)
        graphs = StepGraphs(lambda b, n: forward_loss(prepared, b, n), params, device, version=version)
    batches = _batches(model.config.vocab_size)
    losses, counts = [], []
    counters = Counters()
    with counters.active():
        for s in range(0, len(batches), accum):
            micro = batches[s : s + accum]
            norm = sum(b.num_trained_tokens for b in micro)
            total = torch.zeros((), device=device)
            for b in micro:
                if graphs is not None:
                    total += graphs.forward_backward(b, norm)
                else:
                    dev = b.to(device)
                    loss = forward_loss(prepared, dev, norm)
                    loss.backward()
                    total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(total))
            counts.append(counters.reset())
    final = [p.detach().float().clone() for p in params]
    return losses, final, counts, graphs


@pytest.mark.parametrize(
    ("family", "dtype", "offload"),
    [
        ("qwen3", torch.float32, "off"),
        ("llama", torch.bfloat16, "off"),
        ("qwen3", torch.float32, "double"),  # the copies to host memory and back inside the graph
        ("llama", torch.bfloat16, "single"),
    ],
)
def test_graphed_steps_train_like_eager_steps(family, dtype, offload):
    eager_losses, eager_final, eager_counts, _ = _train(family, dtype, graphs_on=False, offload=offload)
    losses, final, counts, graphs = _train(family, dtype, graphs_on=True, offload=offload)
    from collections import Counter

    from engine.train.step_graph import StepGraphs

    # The first micro-batch of each token count runs eagerly (the warm-up); every later one replays,
    # its bucket captured first if it is new.
    keys = [StepGraphs.key(b) for b in _batches(128)]
    warmed, captured, replays = set(), set(), 0
    for k in keys:
        if (k[0], k[2]) not in warmed:
            warmed.add((k[0], k[2]))
            continue
        captured.add(k)
        replays += 1
    assert graphs.captures == len(captured) >= 2, Counter(keys)
    assert graphs.replays == replays >= 16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for s, (a, b) in enumerate(zip(losses, eager_losses)):
        assert abs(a - b) <= tol * abs(b), (s, losses, eager_losses)
    assert eager_losses[-1] < eager_losses[0] - 0.05  # the run learns, so the comparison means something
    for a, b in zip(final, eager_final):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol)

    # A replay counts what its capture counted: the last step's fast-path calls equal eager's, less
    # the adapter-cache builds (the graphs make them in every pass) and the folded GEMMs: those run
    # from FOLD_MIN_ROWS rows, and a graph's bucket pads these 1,000-token batches past it.
    def same_path(k: str) -> bool:
        return k != "lora_cache_builds" and not k.startswith(("folded_gemm", "wide_rows"))

    assert {k: v for k, v in counts[-1].items() if same_path(k)} == {
        k: v for k, v in eager_counts[-1].items() if same_path(k)
    }


def test_replays_make_no_host_sync():
    """The point of a graph: a replayed micro-batch asks the device nothing."""
    losses, final, counts, graphs = _train("qwen3", torch.bfloat16, graphs_on=True, accum=1)
    from engine.data.collate import PackedBatch

    batch = PackedBatch.from_documents([[1, 2, 3, 4] * 200, [5, 6, 7] * 100])
    graphs.forward_backward(batch, batch.num_trained_tokens)  # warm-up of its shapes
    graphs.forward_backward(batch, batch.num_trained_tokens)  # capture, replay
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = graphs.forward_backward(batch, batch.num_trained_tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss)


def test_a_capture_spoiled_by_a_read_back_names_the_line_that_read():
    # The failure may surface at the capture's end; the watch names the op's caller (this file).
    from engine.train.step_graph import SyncWatch

    x = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    watch = SyncWatch()
    with pytest.raises(Exception):
        with watch, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            y = x * 2
            int(y.sum().item())  # the read back
    torch.cuda.synchronize()
    assert "test_step_graph_gpu.py:" in watch.place, watch.place
    assert torch.cuda.get_sync_debug_mode() == 0
