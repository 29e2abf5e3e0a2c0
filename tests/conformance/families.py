"""Tiny model folders of real model families, built from llama.cpp's upstream files (see
upstream.py): for each family its architecture class from transformers (2 layers, hidden 64, random
weights), its vocabulary rebuilt from a `ggml-vocab-*.gguf` and checked against llama.cpp's
reference tokenizations (vocab.py), its special tokens, and its official chat template: the
`models/templates/<HF repo>.jinja` file, or the template of a named case in
`tests/test-chat-template.cpp` where the templates folder has none.

    from tests.conformance.families import FAMILIES, build_family_folder, conversations_for
    folder = build_family_folder("qwen3")        # cached; AutoTokenizer / AutoModelForCausalLM load it
    for name, messages in conversations_for("qwen3").items(): ...

The families themselves (vocabulary, template, special tokens, end-of-turn tokens, and what is
exact and what is the closest stand-in) are declared in family_table.py; this module builds from them.

The folder cache lives beside the upstream files (upstream.cache_root()), keyed on the family,
the llama-cpp-python version and this file's FOLDER_VERSION; delete it to rebuild.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from tests.conformance import upstream
from tests.conformance.conversations import CONVERSATIONS, REASONING, WITH_SYSTEM

# Re-exported (imported `as` itself): the export tests import it from here with FAMILIES.
from tests.conformance.family_table import EXPORT_FAMILIES as EXPORT_FAMILIES
from tests.conformance.family_table import FAMILIES, Family

FOLDER_VERSION = 3  # bump when what a folder holds changes


def conversations_for(name: str) -> dict[str, list[dict]]:
    """The corpus conversations this family's template can render as they are: reasoning ones only
    where the template parses <think>; system ones only where it accepts a system message."""
    fam = FAMILIES[name]
    return {
        k: v
        for k, v in CONVERSATIONS.items()
        if (fam.reasoning or k not in REASONING) and (fam.system or k not in WITH_SYSTEM)
    }


# -- templates ---------------------------------------------------------------------------------
_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}


def _c_string(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: _C_ESCAPES.get(m.group(1), "\\" + m.group(1)), literal)


def cpp_template(case: str) -> str:
    """The template_str of the named case in tests/test-chat-template.cpp (its C literals joined)."""
    source = (upstream.upstream_dir() / "tests" / "test-chat-template.cpp").read_text(encoding="utf-8")
    head = source.find(f'/* .name= */ "{_c_literal(case)}"')
    if head < 0:
        raise KeyError(f"test-chat-template.cpp has no case named {case!r}")
    start = source.index("/* .template_str= */", head) + len("/* .template_str= */")
    end = source.index("/* .expected_output= */", start)
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', source[start:end])
    return "".join(_c_string(p) for p in parts)


def _c_literal(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def chat_template(fam: Family) -> str:
    if fam.template.startswith("cpp:"):
        return cpp_template(fam.template[4:])
    return upstream.template(fam.template)


# -- folders -----------------------------------------------------------------------------------
_NOT_SPECIAL = frozenset({"<think>", "</think>"})


def build_tokenizer(fam: Family):
    """The family's tokenizer: its vocabulary (checked against llama.cpp), its special tokens and
    its chat template."""
    from tokenizers import AddedToken

    from tests.conformance.vocab import rebuild

    tok = rebuild(fam.vocab)
    vocab = tok.get_vocab()
    missing = [s for s in fam.specials if s not in vocab]
    if missing:
        # <think> / </think> are added tokens but not special in the real Qwen3, SmolLM3 and
        # DeepSeek-R1 tokenizers (decoding keeps them); the turn markers are special.
        tok.add_tokens(
            [AddedToken(s, special=s not in _NOT_SPECIAL, normalized=False) for s in missing], special_tokens=False
        )
    for attr in ("bos", "eos", "pad"):
        value = getattr(fam, attr)
        if value is not None:
            if value not in tok.get_vocab():
                tok.add_tokens([AddedToken(value, special=True, normalized=False)], special_tokens=True)
            setattr(tok, f"{attr}_token", value)
    # The chat template writes the BOS itself where the family has one in its template; the
    # tokenizer adds nothing when encoding a rendered conversation (add_special_tokens=False).
    tok.chat_template = chat_template(fam)
    return tok


def _tiny_config(fam: Family, vocab_size: int, tok):
    from transformers import AutoConfig

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    if fam.model_type == "gpt_oss":
        shape.update(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    if fam.model_type in ("gemma2", "gemma4_text"):
        shape.update(layer_types=["sliding_attention", "full_attention"])
    if fam.model_type == "gemma4_text":
        shape.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    cfg = AutoConfig.for_model(fam.model_type, **shape)
    for attr in ("bos", "eos", "pad"):
        token = getattr(tok, f"{attr}_token", None)
        setattr(cfg, f"{attr}_token_id", tok.convert_tokens_to_ids(token) if token else None)
    return cfg


def build_family_folder(name: str, root: Path | None = None) -> Path:
    """A model folder transformers loads (AutoTokenizer, AutoModelForCausalLM), built once and cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.export.gguf import LLAMA_CPP_PYTHON

    fam = FAMILIES[name]
    root = root or upstream.cache_root() / f"families-{LLAMA_CPP_PYTHON}-v{FOLDER_VERSION}"
    folder = root / name
    if (folder / "done.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    # A staging folder of its own, so two test processes building the same family do not mix.
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.partial-", dir=root))
    tok = build_tokenizer(fam)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(fam, len(tok), tok))
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    (staging / "done.json").write_text(json.dumps({"family": name, "vocab": fam.vocab, "template": fam.template}))
    try:
        staging.rename(folder)
    except OSError:  # another process finished it first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "done.json").is_file():
            raise
    return folder
