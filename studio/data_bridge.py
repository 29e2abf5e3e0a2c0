"""The Data page's calls into engine.data.preview, each meant for a pool thread.

One lock serialises tokenizer use: a fast tokenizer shared by two threads can fail with
"Already borrowed" when one of them changes its truncation settings.
"""

from __future__ import annotations

import threading
from typing import Any

_tokenizer_lock = threading.Lock()


def data_config(data: dict[str, Any]):
    from engine.config import DataConfig, RunConfig

    # Validate through RunConfig so a bad field reads as "data.max_seq_len: ...".
    return RunConfig.from_dict({"data": data}).data if data else DataConfig()


def model_config(model: dict[str, Any]):
    from engine.config import RunConfig

    return RunConfig.from_dict({"model": model}).model


def load_preview(data: dict[str, Any]):
    from engine.data import preview

    return preview.load_preview(data_config(data))


def load_tokenizer(model: dict[str, Any]):
    from engine.data import preview

    loader = getattr(preview, "load_tokenizer", None)
    if loader is None:
        from engine.models.loading import load_tokenizer as loader
    with _tokenizer_lock:
        return loader(model_config(model))


def render_example(tokenizer, data: dict[str, Any], index: int):
    from engine.data import preview

    with _tokenizer_lock:
        return preview.render_example(tokenizer, data_config(data), index)


def packing_layout(tokenizer, data: dict[str, Any]):
    from engine.data import preview

    with _tokenizer_lock:
        return preview.packing_layout(tokenizer, data_config(data))
