"""Packed-sequence metadata: PackedSeqInfo and the attention block tables, against naive loops."""

import random

import pytest
import torch

from engine.counters import current
from engine.fastpath import packed
from engine.fastpath.packed import PackedSeqInfo
from engine.kernels import varlen_attention
from engine.kernels.varlen_attention import device_block_table, host_block_table


def _naive(lengths):
    cu, pos, start = [0], [], 0
    for n in lengths:
        pos.extend(range(n))
        start += n
        cu.append(start)
    return cu, pos


@pytest.mark.parametrize(
    "lengths",
    [[1], [7], [1, 1, 1], [5, 1, 20, 37], [2048, 16, 300], [random.Random(s).randint(1, 90) for s in range(40)]],
)
def test_from_lengths_matches_naive(lengths):
    info = PackedSeqInfo.from_lengths(lengths)
    cu, pos = _naive(lengths)
    assert info.cu_seqlens.dtype == torch.int32
    assert info.cu_seqlens.tolist() == cu
    assert info.position_ids.dtype == torch.int64
    assert info.position_ids.tolist() == pos
    assert info.max_seqlen == max(lengths) and isinstance(info.max_seqlen, int)
    assert info.total_tokens == sum(lengths)
    kw = info.model_kwargs()
    assert kw["position_ids"].shape == (1, sum(lengths))
    assert kw["cu_seq_lens_q"] is info.cu_seqlens and kw["max_length_k"] == max(lengths)


@pytest.mark.parametrize("bad", [[], [3, 0, 2], [-1]])
def test_from_lengths_rejects_bad(bad):
    with pytest.raises(ValueError):
        PackedSeqInfo.from_lengths(bad)


def test_counters_count_builds_and_reset():
    packed.reset_counters()
    PackedSeqInfo.from_lengths([3, 4])
    PackedSeqInfo.from_lengths([1])
    assert packed.reset_counters() == {"metadata_builds": 2, "host_syncs": 0, "moe_calls": 0}
    assert not any(current().values())


def test_cpu_to_returns_self_and_lookup_finds_owner():
    info = PackedSeqInfo.from_lengths([3, 4])
    assert info.to("cpu") is info
    assert packed.lookup(info.cu_seqlens) is info
    assert packed.lookup(info.cu_seqlens.clone()) is None


def test_from_position_ids_roundtrip_and_rows():
    lengths = [4, 1, 6, 3]
    info = PackedSeqInfo.from_lengths(lengths)
    packed.reset_counters()
    again = PackedSeqInfo.from_position_ids(info.position_ids.unsqueeze(0))
    assert again.lengths == lengths
    assert again.cu_seqlens.tolist() == info.cu_seqlens.tolist()
    assert current()["metadata_builds"] == 1
    # Two rows of plain positions: each row is one document even though row 2 does not restart.
    rows = torch.tensor([[0, 1, 2, 0, 1], [5, 6, 7, 8, 9]])
    assert PackedSeqInfo.from_position_ids(rows).lengths == [3, 2, 5]


def _covered(table, lengths, block):
    cu, _ = _naive(lengths)
    seen = []
    for doc, start in table.tolist():
        assert cu[doc] <= start < cu[doc + 1]
        assert (start - cu[doc]) % block == 0  # blocks tile each document from its start
        seen.extend(range(start, min(start + block, cu[doc + 1])))
    return sorted(seen)


@pytest.mark.parametrize("block", [16, 64, 128])
@pytest.mark.parametrize("kind", ["q", "k"])
def test_host_block_table_covers_each_token_once_heaviest_first(block, kind):
    rng = random.Random(block)
    lengths = [rng.randint(1, 300) for _ in range(25)] + [1, block, block + 1]
    table = host_block_table(lengths, block, kind)
    assert table.dtype == torch.int32 and table.shape[1] == 2
    assert table.shape[0] == sum((n + block - 1) // block for n in lengths)
    assert _covered(table, lengths, block) == list(range(sum(lengths)))
    cu, _ = _naive(lengths)
    if kind == "q":
        work = [start - cu[doc] + block for doc, start in table.tolist()]
    else:
        work = [cu[doc + 1] - start for doc, start in table.tolist()]
    assert work == sorted(work, reverse=True)


def test_device_block_table_matches_host_table_as_a_set():
    lengths = [5, 1, 20, 37, 64, 65]
    info = PackedSeqInfo.from_lengths(lengths)
    table, bound = device_block_table(info.cu_seqlens, info.total_tokens, 16)
    rows = [tuple(r) for r in table.tolist()]
    assert bound == len(rows)
    real = [r for r in rows if r[0] >= 0]
    assert all(r == (-1, 0) for r in rows[len(real) :])  # padding only at the end
    assert sorted(real) == sorted(tuple(r) for r in host_block_table(lengths, 16, "q").tolist())


def test_info_block_table_is_cached():
    info = PackedSeqInfo.from_lengths([40, 3])
    t1, n1 = info.block_table("q", 16)
    t2, n2 = info.block_table("q", 16)
    assert t1 is t2 and n1 == n2 == 4
    info.free()
    assert info.block_table("q", 16)[0] is not t1


def test_table_blocks_cover_the_kernel_configs():
    # PackedSeqInfo.to(cuda) queues tables for TABLE_BLOCKS: every tile size the autotuned
    # kernels may pick must be among them.
    blocks = set(varlen_attention.TABLE_BLOCKS)
    for table in (varlen_attention._FWD_CONFIGS, varlen_attention._DQ_CONFIGS):
        assert {c.kwargs["BLOCK_M"] for cs in table.values() for c in cs} <= blocks
    assert {c.kwargs["BLOCK_N"] for cs in varlen_attention._DKDV_CONFIGS.values() for c in cs} <= blocks
