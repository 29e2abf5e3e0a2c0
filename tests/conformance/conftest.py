"""Session fixtures of the conformance suite: llama.cpp's upstream files (fetched from the package
registry once, at test-data build time, and cached) and the tiny family folders built from them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def upstream_files():
    """The cached folder of llama.cpp files (upstream.upstream_dir()); fetched on first use."""
    from tests.conformance.upstream import upstream_dir

    return upstream_dir()


@pytest.fixture(scope="session")
def family_folder(upstream_files):
    """`family_folder(name)` -> the tiny model folder of that family (built once, cached on disk)."""
    from tests.conformance.families import build_family_folder

    return build_family_folder


@pytest.fixture(scope="session")
def family_tokenizer(family_folder):
    """`family_tokenizer(name)` -> the family's tokenizer loaded from its folder (one per session)."""
    from transformers import AutoTokenizer

    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(family_folder(name))
        return cache[name]

    return load
