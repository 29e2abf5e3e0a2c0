"""One varlen attention call's launches (engine.kernels.varlen_attention): `_Launch` holds the
call's shared arguments (shapes, GQA group, scale, mask flags, the block-table provider) and
launches each kernel, through its autotuner or with a fixed config (varlen_attention_configs).

A fixed config the card's shared memory cannot hold (an RTX card's 99 KiB at head dims 256 and
512, where the configs are sized for Hopper's 227 KiB) is shrunk at its first launch, before
anything runs (Triton raises OutOfResources when it loads the kernel), and the fitted one is kept
for the process, so a CUDA graph's capture launches it with no retry.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from triton.runtime.errors import OutOfResources

from engine.counters import count
from engine.kernels.varlen_attention_configs import (
    _KEY_BLOCK_KINDS,
    AUTOTUNED_MAX_HEAD_DIM,
    LONG_DOCUMENT,
    MAX_HEAD_DIM,
    TABLE_BLOCKS,
    _fixed,
    _use_autotune,
    fixed_pack,
    shrink,
    tuning,
)

LOG2E = 1.4426950408889634

# A table provider maps (kind, block) -> (int32 table [n, 2] on the device, n). kind "q": blocks of
# queries (forward, dQ), ordered by the keys they visit; kind "k": blocks of keys (dK/dV).
TableFn = Callable[[str, int], "tuple[torch.Tensor, int]"]

# The query-block kernels, whose launches take PACK (engine.kernels.varlen_attention_configs.PACK_ENV).
_PACKED_KINDS = ("fwd", "dq")

# Fixed launch configs shrunk to fit a card's shared memory: {(kind, config, fp32, pack, device): fitted}.
_FITTED: dict = {}


class _Launch:
    """Shared arguments of one attention call (shapes, flags, tables)."""

    def __init__(
        self,
        q,
        k,
        cu_seqlens,
        tables: TableFn,
        scale,
        causal,
        sliding_window,
        softcap,
        blocks,
        covers_all,
        longest: Optional[int] = None,
        backward: str = "split",
    ):
        t, hq, d = q.shape
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
        if d < 16 or d > MAX_HEAD_DIM or d & (d - 1):
            raise ValueError(f"head_dim must be a power of two in [16, {MAX_HEAD_DIM}], got {d}")
        self.t, self.hq, self.hkv, self.d = t, hq, hkv, d
        self.group = hq // hkv
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.causal = bool(causal)
        self.has_window = sliding_window is not None
        self.window = int(sliding_window) if self.has_window else 0
        if self.has_window and self.window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.has_softcap = softcap is not None and float(softcap) > 0
        if self.has_softcap:
            self.mul_a = self.scale / float(softcap)
            self.mul_b = float(softcap) * LOG2E
        else:
            self.mul_a = self.scale * LOG2E
            self.mul_b = 1.0
        self.cu = cu_seqlens
        self.tables = tables
        self.covers_all = bool(covers_all)
        self.blocks = blocks  # pinned (table block, step block) for tests, else None
        self.longest = longest  # the longest document's length when the caller knows it, else None
        self.backward = backward  # "split" or "onepass" (engine.kernels.varlen_attention_bwd)
        new = tuning() == "new"
        # The split kernels' autotuning key and untuned-config choice (LONG_DOCUMENT); the old
        # launch choices have no such bucket.
        self.long_docs = int(new and longest is not None and longest >= LONG_DOCUMENT)
        self.rebuild_addr = new  # the dK/dV kernel's per-step addresses (see _dkdv_inner)
        # fp32 inputs get exact fp32 products (the point of fp32 is a tight check); 16-bit inputs
        # use Triton's default.
        self.fp32 = q.dtype == torch.float32
        self.dot_prec = "ieee" if self.fp32 else None
        self.flags = dict(
            GROUP=self.group,
            HEAD_DIM=d,
            CAUSAL=self.causal,
            HAS_WINDOW=self.has_window,
            HAS_SOFTCAP=self.has_softcap,
            DOT_PREC=self.dot_prec,
        )

    def run(self, kind, tuned, plain, heads, head_args, tail_args, defaults=None, extra=None):
        """Launch one kernel: `tuned` (autotuned) or `plain` with a fixed config (`defaults`, see
        _fixed). The block table is indexed by BLOCK_M for fwd/dq (query blocks) and by BLOCK_N
        for dkdv and onepass (key blocks). `extra`: this kernel's own constexpr arguments."""
        flags = {**self.flags, **(extra or {})}
        key_blocks = kind in _KEY_BLOCK_KINDS
        table_key = "BLOCK_N" if key_blocks else "BLOCK_M"
        table_kind = "k" if key_blocks else "q"
        if self.blocks is None and _use_autotune() and not self.fp32 and self.d <= AUTOTUNED_MAX_HEAD_DIM:
            ta, na = self.tables(table_kind, TABLE_BLOCKS[0])
            tb, nb = self.tables(table_kind, TABLE_BLOCKS[1])
            counts = {TABLE_BLOCKS[0]: na, TABLE_BLOCKS[1]: nb}
            # A packed candidate's program serves PACK query heads (fwd, dq).
            grid = lambda meta: (heads // meta.get("PACK", 1), max(counts[meta[table_key]], 1))  # noqa: E731
            tuned[grid](*head_args, ta, tb, *tail_args, BLOCK_A=TABLE_BLOCKS[0], **flags)
            return
        config = _fixed(kind, self.d, self.blocks, self.fp32, defaults, bool(self.long_docs))
        if kind in _PACKED_KINDS:
            flags["PACK"] = pack = fixed_pack(self.group) if not self.long_docs else 1
            heads //= pack
        # A config this card's shared memory could not hold was shrunk once (shrink); the fitted
        # one is kept for the process, so a step graph's capture launches it with no retry.
        fit_key = (kind, config, self.fp32, flags.get("PACK", 1), self.cu.device)
        config = _FITTED.get(fit_key, config)
        while True:
            bm, bn, warps, stages = config
            tblock = bn if key_blocks else bm
            ta, na = self.tables(table_kind, tblock)
            try:
                plain[(heads, max(na, 1))](
                    *head_args,
                    ta,
                    ta,
                    *tail_args,
                    BLOCK_A=tblock,
                    **flags,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    num_warps=warps,
                    num_stages=stages,
                )
                return
            except OutOfResources:  # raised before anything is launched
                smaller = shrink(kind, config)
                if smaller is None:
                    raise
                count("attention:shrunk_tiles")  # still this kernel, smaller tiles: not a fallback
                config = _FITTED[fit_key] = smaller
