"""A SentencePiece `tokenizer.model` for a conformance family with a SentencePiece vocabulary,
rebuilt from the llama.cpp `ggml-vocab-*.gguf` its tokenizer came from: the pieces, scores and
token types llama.cpp converted from the original tokenizer.model, with the original's BPE model
type, byte fallback, special ids and space-prefix setting. The family folders hold only
tokenizer.json (what transformers 5 saves); a Hub repository of these families ships
tokenizer.model beside it, and llama.cpp's converter reads the vocabulary from that file."""

from __future__ import annotations

from pathlib import Path

from tests.conformance.upstream import vocab_file


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def write_tokenizer_model(fam, folder: Path) -> Path:
    """folder/tokenizer.model for `fam` (a tests.conformance.families.Family)."""
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as spm

    reader = GGUFReader(str(vocab_file(fam.vocab)))
    if _field(reader, "tokenizer.ggml.model") != "llama":
        raise ValueError(f"ggml-vocab-{fam.vocab}.gguf is not a SentencePiece vocabulary")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    proto = spm.ModelProto()
    for i, (text, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        piece = proto.pieces.add()
        # llama.cpp keeps SentencePiece's token types, except that its [PADn] fillers are typed
        # unknown; a SentencePiece model has one unknown piece, so they become unused ones.
        kind = 5 if int(kind) == 2 and i != unk else int(kind)
        piece.piece, piece.score, piece.type = text, float(score), kind
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = any(int(k) == 6 for k in types)
    proto.trainer_spec.vocab_size = len(tokens)
    for name, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        setattr(proto.trainer_spec, name, -1 if value is None else int(value))
    add_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True if add_prefix is None else bool(add_prefix)
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    path = folder / "tokenizer.model"
    path.write_bytes(proto.SerializeToString())
    return path
