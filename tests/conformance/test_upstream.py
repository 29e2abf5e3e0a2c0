"""The fixtures themselves: every rebuilt vocabulary reproduces llama.cpp's reference
tokenizations (and the check catches a tokenizer that does not), and the templates read out of
tests/test-chat-template.cpp render llama.cpp's own expected outputs."""

from __future__ import annotations

import re

import pytest
from tokenizers import pre_tokenizers

from tests.conformance.families import FAMILIES, _c_literal, _c_string, cpp_template
from tests.conformance.vocab import VocabMismatch, check_against_reference, rebuild

# llama.cpp's test conversation (tests/test-chat-template.cpp), rendered with a generation prompt.
LLAMA_CPP_CHAT = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]


def test_every_vocabulary_matches_llama_cpp(upstream_files):
    for name in sorted({f.vocab for f in FAMILIES.values()}):
        tok = rebuild(name)  # raises VocabMismatch on any disagreement
        assert check_against_reference(tok, name) > 20


def test_the_reference_check_catches_a_wrong_pre_tokenizer(upstream_files):
    tok = rebuild("llama-bpe")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split
    with pytest.raises(VocabMismatch, match="ggml-vocab-llama-bpe"):
        check_against_reference(tok, "llama-bpe")


def _expected(case: str) -> tuple[str, str, str]:
    """(expected render, bos, eos) of a test-chat-template.cpp case (the jinja one when it differs)."""
    source = (upstream_files_dir() / "tests" / "test-chat-template.cpp").read_text(encoding="utf-8")
    head = source.index(f'/* .name= */ "{_c_literal(case)}"')
    block = source[head : source.index("},", head)]

    def field(name: str) -> str:
        at = block.find(f"/* .{name}= */")
        if at < 0:
            return ""
        rest = block[at + len(name) + 8 :]
        rest = rest[: rest.find("/* .")] if "/* ." in rest else rest
        return "".join(_c_string(p) for p in re.findall(r'"((?:[^"\\]|\\.)*)"', rest))

    return field("expected_output_jinja") or field("expected_output"), field("bos_token"), field("eos_token")


def upstream_files_dir():
    from tests.conformance.upstream import upstream_dir

    return upstream_dir()


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.template.startswith("cpp:") and f.system])
def test_templates_from_the_cpp_tests_render_llama_cpps_expected_output(name, upstream_files):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    case = FAMILIES[name].template[4:]
    want, bos, eos = _expected(case)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(cpp_template(case))
    got = template.render(messages=LLAMA_CPP_CHAT, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    assert got == want
