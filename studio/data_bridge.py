"""The Data page's calls into the engine's data preview (engine.api), each meant for a pool thread.

The page loads the model's tokenizer through `load_tokenizer` and hands it to `render_example`
and `packing_layout`: the engine's data code receives a tokenizer and never loads one.

One lock serialises use of the shared tokenizer: a fast tokenizer shared by two threads can fail
with "Already borrowed" when one of them changes its truncation settings. The whole-file passes
(packing, X-ray) work on a copy of their own, so the Example tab is never stuck behind them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from engine import api

_tokenizer_lock = threading.Lock()


def data_config(data: dict[str, Any]):
    # Validate through RunConfig so a bad field reads as "data.max_seq_len: ...".
    return api.RunConfig.from_dict({"data": data}).data if data else api.DataConfig()


def model_config(model: dict[str, Any]):
    return api.RunConfig.from_dict({"model": model}).model


def load_preview(data: dict[str, Any], method: str = "sft"):
    """`method`: training.method, whose data kind is read first (a KTO or GRPO file)."""
    return api.load_preview(data_config(data), method)


def load_tokenizer(model: dict[str, Any]):
    with _tokenizer_lock:
        return api.load_tokenizer(model_config(model))


def render_example(tokenizer, data: dict[str, Any], index: int, method: str = "sft"):
    with _tokenizer_lock:
        return api.render_example(tokenizer, data_config(data), index, method)


def _own_copy(tokenizer):
    """A tokenizer of the scan's own: a whole-file pass holding the shared one's lock for minutes
    would keep the Example tab from rendering the row a person asks for."""
    with _tokenizer_lock:
        return copy.deepcopy(tokenizer)


def packing_layout(tokenizer, data: dict[str, Any], progress=None, cancelled=None, method: str = "sft"):
    """(layout of the first rows, the data set's row count): engine.api.packing_scan."""
    return api.packing_scan(
        _own_copy(tokenizer), data_config(data), progress=_fraction(progress), cancelled=cancelled, method=method
    )


def xray(tokenizer, data: dict[str, Any], progress=None, cancelled=None):
    return api.xray_scan(data_config(data), _own_copy(tokenizer), progress=_fraction(progress), cancelled=cancelled)


def _fraction(progress):
    """The task's progress signal gets (rows done, rows in all)."""
    if progress is None:
        return None
    return lambda done, total: progress((done, total))
