"""Whole-data-set passes for the window (the X-ray, the packing view) that report progress, can be
stopped, and stay in bounded memory on big files.

A 200 MB JSONL (354,657 rows) took the X-ray over 30 minutes with no progress and no way to stop
it, while the packing view tokenized every row into Python lists (1.3 → 4.4 GB). Here the rows are
read from the Arrow table in batches (`Rows`), every batch reports `progress(done, total)` and asks
`cancelled()`; the packing view packs a leading sample (`PACKING_SAMPLE` rows: its picture and
efficiency do not change past that), while the X-ray still checks every row. The checks themselves
are engine.data.xray's and engine.data.preview's, unchanged.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from engine.config import DataConfig
from engine.data.preview import PackingLayout, _raw, packing_layout
from engine.data.xray import XRay, xray

BATCH = 250  # rows per Arrow batch: progress and cancel are checked this often (a second or two loaded)
PACKING_SAMPLE = 20_000  # rows the packing view packs (the training run packs all)

Progress = Optional[Callable[[int, int], None]]
Cancel = Optional[Callable[[], bool]]


class Cancelled(Exception):
    """The caller's `cancelled()` said stop; nothing was returned."""


class Rows:
    """The first `limit` rows of a datasets.Dataset (all when 0), iterated in Arrow batches: what
    xray() and prepare_dataset() iterate, with progress and a stop check between batches."""

    def __init__(self, ds, limit: int = 0, progress: Progress = None, cancelled: Cancel = None):
        self.ds = ds
        self.total = min(len(ds), limit) if limit else len(ds)
        self.column_names = list(ds.column_names)
        self.progress, self.cancelled = progress, cancelled

    def __len__(self) -> int:
        return self.total

    def batches(self) -> Iterator[tuple[int, list[dict]]]:
        """(index of the batch's first row, its rows), BATCH rows at a time: what the X-ray renders and
        tokenizes together (engine.data.render.tokenize_examples)."""
        done = 0
        columns = self.column_names
        while done < self.total:
            if self.cancelled is not None and self.cancelled():
                raise Cancelled()
            end = min(self.total, done + BATCH)
            batch = self.ds[done:end]  # one columnar slice: {column: [values]}
            yield done, [{c: batch[c][j] for c in columns} for j in range(end - done)]
            done = end
            if self.progress is not None:
                self.progress(done, self.total)

    def __iter__(self) -> Iterator[dict]:
        for _, rows in self.batches():
            yield from rows


def xray_scan(cfg: DataConfig, tokenizer, progress: Progress = None, cancelled: Cancel = None) -> XRay:
    """The X-ray of every row (engine.data.xray), batch by batch, with progress and a stop check."""
    return xray(cfg, tokenizer, raw=Rows(_raw(cfg), 0, progress, cancelled))


def packing_scan(
    tokenizer,
    cfg: DataConfig,
    progress: Progress = None,
    cancelled: Cancel = None,
    limit: int = PACKING_SAMPLE,
    method: str = "sft",
) -> tuple[PackingLayout, int]:
    """(the packing layout of the first `limit` rows, the data set's row count), for `method`."""
    ds = _raw(cfg)
    return packing_layout(tokenizer, cfg, raw=Rows(ds, limit, progress, cancelled), method=method), len(ds)
