"""Best-fit-decreasing packing of tokenized examples into rows of at most `row_tokens` tokens.

Each row keeps its document boundaries (the lengths go to PackedSeqInfo), so packing never
lets attention or positions cross from one example into the next.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class PackingResult:
    rows: list[list[int]]  # document indices per row
    row_tokens: int
    total_tokens: int

    @property
    def efficiency(self) -> float:
        """Fraction of row capacity holding real tokens."""
        cap = len(self.rows) * self.row_tokens
        return self.total_tokens / cap if cap else 0.0

    def padding_avoided(self, num_docs: int, longest: int) -> int:
        """Pad tokens a one-example-per-row batch padded to the longest example would have used."""
        return num_docs * longest - self.total_tokens


def pack_best_fit_decreasing(lengths: list[int], row_tokens: int) -> PackingResult:
    """Place the longest documents first, each into the fullest row that still fits it."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    # Sorted (space left, row index) pairs: bisect finds the tightest row that fits.
    free: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        if n > row_tokens:
            raise ValueError(f"document {i} has {n} tokens, more than a row's {row_tokens}")
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            space, r = free.pop(pos)
            rows[r].append(i)
            space -= n
        else:
            r = len(rows)
            rows.append([i])
            space = row_tokens - n
        if space > 0:
            bisect.insort(free, (space, r))
    return PackingResult(rows, row_tokens, sum(lengths))
