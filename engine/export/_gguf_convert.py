"""Run llama.cpp's own `convert_hf_to_gguf.py` from the copy fetched with its `gguf-py` (see
engine/export/gguf.py), in a subprocess: `python _gguf_convert.py LLAMA_CPP_DIR ARGS...`.

Run by path, not imported: the converter must see the `gguf` package it shipped with (first on
sys.path here), not whichever `gguf` release is installed, and its module-level state stays out
of the studio's process.

One addition: llama.cpp names a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, so a tokenizer trained from scratch (the demo model's, or any small custom one) is
"not recognized" even when its pre-tokenizer is plain GPT-2 byte-level splitting. Only in that
case, when tokenizer.json says exactly that (ByteLevel with the GPT-2 regex and nothing else),
this runner answers "gpt-2", llama.cpp's name for that split. The self-check then compares
llama.cpp's tokenization of the held-out prompts with the tokenizer's, token for token.
"""

import json
import sys
from pathlib import Path


def _plain_byte_level(dir_model: Path) -> bool:
    try:
        pre = json.loads((dir_model / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True


def main() -> None:
    root = Path(sys.argv[1])
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import conversion.base as base  # noqa: E402  (from the fetched llama.cpp copy)

    recognised = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if _plain_byte_level(Path(self.dir_model)):
                print("tunesmith: unrecognised BPE pre-tokenizer is plain GPT-2 byte-level; using 'gpt-2'", flush=True)
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf  # noqa: E402

    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
