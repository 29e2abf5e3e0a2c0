"""The Data page's calls into the engine's data preview (engine.api), each meant for a pool thread.

The page loads the model's tokenizer through `load_tokenizer` and hands it to `render_example`
and `packing_layout`: the engine's data code receives a tokenizer and never loads one.

One lock serialises tokenizer use: a fast tokenizer shared by two threads can fail with
"Already borrowed" when one of them changes its truncation settings.
"""

from __future__ import annotations

import threading
from typing import Any

from engine import api

_tokenizer_lock = threading.Lock()


def data_config(data: dict[str, Any]):
    # Validate through RunConfig so a bad field reads as "data.max_seq_len: ...".
    return api.RunConfig.from_dict({"data": data}).data if data else api.DataConfig()


def model_config(model: dict[str, Any]):
    return api.RunConfig.from_dict({"model": model}).model


def load_preview(data: dict[str, Any]):
    return api.load_preview(data_config(data))


def load_tokenizer(model: dict[str, Any]):
    with _tokenizer_lock:
        return api.load_tokenizer(model_config(model))


def render_example(tokenizer, data: dict[str, Any], index: int):
    with _tokenizer_lock:
        return api.render_example(tokenizer, data_config(data), index)


def packing_layout(tokenizer, data: dict[str, Any]):
    with _tokenizer_lock:
        return api.packing_layout(tokenizer, data_config(data))


def xray(tokenizer, data: dict[str, Any]):
    with _tokenizer_lock:
        return api.xray(data_config(data), tokenizer)
