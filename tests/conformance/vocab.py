"""A Hugging Face fast tokenizer rebuilt from one of llama.cpp's `models/ggml-vocab-*.gguf` files,
checked against llama.cpp's reference tokenizations (`.inp`/`.out`) before anything uses it.

The rebuild is transformers' own GGUF tokenizer path (transformers.integrations.gguf: the reader and
the builder `from_pretrained(..., gguf_file=...)` uses), with every metadata array read, so the
vocabulary's control tokens stay whole. `rebuild(name)` raises VocabMismatch, naming the text and
both tokenizations, when any reference text tokenizes differently from llama.cpp.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    add_gguf_special_tokens,
    select_tokenizer_builder,
    set_split_regex,
)
from transformers.integrations.gguf.reader import read_gguf_metadata

from tests.conformance.upstream import reference_tokenizations, vocab_file

_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id"}


class VocabMismatch(AssertionError):
    """A rebuilt tokenizer disagrees with llama.cpp's recorded tokenization of a reference text."""


def _backend(name: str):
    meta, _ = read_gguf_metadata(str(vocab_file(name)), _STRING_ARRAYS)
    keys = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tdict = {new: meta[f"tokenizer.{old}"] for old, new in keys.items() if f"tokenizer.{old}" in meta}
    tok = select_tokenizer_builder(meta["general.architecture"], tdict.get("tokenizer_type"))(tdict)
    tok = set_split_regex(add_gguf_special_tokens(tok, tdict), tdict)
    _match_llama_cpp(tok, meta, tdict.get("pre_tokenizer_type"))
    specials = {
        k: tdict["tokens"][meta[f"tokenizer.ggml.{v}"]]
        for k, v in _SPECIAL_IDS.items()
        if f"tokenizer.ggml.{v}" in meta
    }
    return tok, specials, meta


def _match_llama_cpp(tok, meta: dict, pre: str | None) -> None:
    """What transformers' GGUF builder leaves out and the upstream tokenizer.json files hold (each
    checked by the reference tokenizations):
    - Llama-3's byte-level BPE takes a word whole when it is in the vocabulary (`ignore_merges`,
      llama.cpp's llama3 pre-tokenizer does the same);
    - StarCoder-style vocabularies (StarCoder, Refact; SmolLM2 and Granite use this shape) split
      every digit on its own before the byte-level split;
    - Llama-2-style sentencepiece prepends '▁' and turns spaces into '▁' in a normalizer, as
      llama.cpp does (Metaspace makes " " one '▁' where llama.cpp has '▁▁')."""
    backend = tok.backend_tokenizer
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        backend.model.ignore_merges = True
    if pre in ("starcoder", "refact"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if meta.get("tokenizer.ggml.model") == "llama" and meta["general.architecture"] == "llama":
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(prepend="\u2581"), normalizers.Replace(pattern=" ", content="\u2581")]
        )
        backend.pre_tokenizer = None


def check_against_reference(tok, name: str) -> int:
    """The number of reference texts checked; VocabMismatch on the first disagreement."""
    cases = reference_tokenizations(name)
    for text, want in cases:
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != want:
            raise VocabMismatch(
                f"ggml-vocab-{name}: the rebuilt tokenizer disagrees with llama.cpp on {text!r}: {got} != {want}"
            )
    return len(cases)


def rebuild(name: str) -> PreTrainedTokenizerFast:
    """The fast tokenizer of ggml-vocab-<name>.gguf, checked against its reference tokenizations."""
    tok, specials, meta = _backend(name)
    # transformers' byte-level builder brings GPT-2's "<|endoftext|>" along as an extra added token
    # past the vocabulary's end; the vocabulary has no such token, so it goes.
    spec = json.loads(tok.backend_tokenizer.to_str())
    size = len(meta["tokenizer.ggml.tokens"])
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **specials)
    check_against_reference(fast, name)
    return fast
