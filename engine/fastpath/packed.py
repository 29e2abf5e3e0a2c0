"""Packed-sequence metadata, built once per batch on the host and reused by every layer.

A packed micro-batch is one token stream holding several documents back to back. Attention
and positions must not cross a document boundary. The collator knows every document's
length, so everything attention needs (cu_seqlens, max_seqlen, positions) is computed here on
the host, moved to the device once, and handed to each decoder layer through the standard
kwargs transformers already threads through (`cu_seq_lens_q/k`, `max_length_q/k`), so no
layer ever has to ask the device for lengths (no device-to-host sync).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

# Metadata builds and host reads are counted in engine.counters (re-exported here).
from engine.counters import BASE_KEYS, count, reset_counters  # noqa: F401

# Device cu_seqlens tensor id -> the PackedSeqInfo that owns it, so the attention function, which
# only receives `cu_seq_lens_q` through the model kwargs, can find the host-built block tables.
# Weak values: an entry leaves with its info; the info keeps its tensor (and so the id) alive.
# Module-level, but no state passes between runs or threads through it: an info is found only by
# the very tensor it owns (`lookup` checks identity, not just the id), so two runs, a probe's
# forwards on another thread and a backward's recompute each find their own batch's info and
# nothing else; a CUDA graph looks it up once, at capture, like every other Python step.
_BY_CU: "weakref.WeakValueDictionary[int, PackedSeqInfo]" = weakref.WeakValueDictionary()


def lookup(cu_seqlens: torch.Tensor) -> Optional["PackedSeqInfo"]:
    """The PackedSeqInfo whose `cu_seqlens` is this very tensor, or None."""
    info = _BY_CU.get(id(cu_seqlens))
    return info if info is not None and info.cu_seqlens is cu_seqlens else None


# Device position_ids storage -> its PackedSeqInfo, for decoder layers that take the packing kwargs
# but do not hand them on to their attention (StableLM and Nemotron in transformers 5.17 pass
# position_ids alone): their attention call finds the batch's metadata from the positions it
# does get, instead of reading them back from the device in every layer. Weak values, as _BY_CU.
_BY_POSITIONS: "weakref.WeakValueDictionary[tuple, PackedSeqInfo]" = weakref.WeakValueDictionary()


def lookup_positions(position_ids: torch.Tensor) -> Optional["PackedSeqInfo"]:
    """The PackedSeqInfo whose positions these are (a view of its own `position_ids`, all of
    them, in order: the same memory, so the same values), or None."""
    if position_ids.numel() == 0 or position_ids.stride(-1) != 1 or position_ids.reshape(-1).stride(0) != 1:
        return None
    info = _BY_POSITIONS.get((position_ids.device, position_ids.data_ptr()))
    if info is None or info.position_ids.numel() != position_ids.numel():
        return None
    return info


@dataclass
class PackedSeqInfo:
    lengths: list[int]
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1]
    max_seqlen: int  # a Python int: kernels size their grids from it without a sync
    position_ids: torch.Tensor  # int64 [total_tokens], restarting at 0 per document
    total_tokens: int
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        _BY_CU[id(self.cu_seqlens)] = self
        if self.position_ids.numel():
            _BY_POSITIONS[(self.position_ids.device, self.position_ids.data_ptr())] = self

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> "PackedSeqInfo":
        lengths = [int(n) for n in lengths]
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"document lengths must be positive, got {lengths[:10]}")
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
        total = int(cu[-1])
        starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lens)
        positions = torch.arange(total, dtype=torch.int64) - starts
        count("metadata_builds")
        return cls(lengths, cu, max(lengths), positions, total)

    def to(self, device: torch.device | str) -> "PackedSeqInfo":
        """The same metadata on `device`, copied once and cached (non-blocking from the host)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        key = str(device)
        if key not in self._device_cache:
            dev = PackedSeqInfo(
                self.lengths,
                _to_device(self.cu_seqlens, device),
                self.max_seqlen,
                _to_device(self.position_ids, device),
                self.total_tokens,
            )
            if device.type == "cuda":
                # Queue the attention block tables with the batch, so no layer builds them: one
                # per block size the varlen kernels tile documents with. (Imported here, like
                # host_block_table below: the collator imports this module and stays light.)
                from engine.kernels.varlen_attention import TABLE_BLOCKS

                for block in TABLE_BLOCKS:
                    for kind in ("q", "k"):
                        dev.block_table(kind, block)
            self._device_cache[key] = dev
        return self._device_cache[key]

    def block_table(self, kind: str, block: int) -> tuple[torch.Tensor, int]:
        """Attention work list for tiles of `block` tokens: int32 [n, 2] rows of (document,
        first token) on this info's device, and n. kind "q": query blocks, "k": key blocks.
        Computed on the host from the known lengths and copied once (no device sync)."""
        cache_key = (kind, block)
        if cache_key not in self._tables:
            from engine.kernels.varlen_attention import host_block_table

            table = host_block_table(self.lengths, block, kind)
            self._tables[cache_key] = (_to_device(table, self.cu_seqlens.device), table.shape[0])
        return self._tables[cache_key]

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackedSeqInfo":
        """Rebuild metadata from positions that restart at 0 per document (one per row too).

        This is what peers do inside every layer; it reads the device (one host sync, counted)
        and is kept for the `cached_metadata=False` ablation and for callers that pass only
        position_ids."""
        pos = position_ids.reshape(-1, position_ids.shape[-1])
        host = pos.to("cpu")
        count("host_syncs")  # a sync on a GPU; counted on every device (see engine.counters)
        starts = host == 0
        starts[:, 0] = True  # a row never continues the previous row's document
        idx = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist() + [host.numel()]
        info = cls.from_lengths([b - a for a, b in zip(idx[:-1], idx[1:])])
        return info.to(pos.device)

    def free(self) -> None:
        """Drop the device copies (the next batch brings its own)."""
        self._device_cache.clear()
        self._tables.clear()

    def model_kwargs(self) -> dict:
        """Kwargs for a transformers decoder forward over a [1, total_tokens] row."""
        return {
            "position_ids": self.position_ids.unsqueeze(0),
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned + non_blocking: the copy is queued on the stream, the host never waits.
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
