"""How answers end and where they start on the official templates beyond issues 19/26 (llama.cpp's
models/templates, families.py): one test per way engine.data.render went wrong on them, each
failing on the render.py before the fix.

- GLM-4.5/4.6/4.7, Apertus, Hunyuan, Apriel write an answer's end-of-turn token only when another
  turn follows, so the last answer trained without it (the model never learns to stop);
- Nemotron-Nano-v2 and Apriel put a newline between the answer and the end token, which was then
  not trained at all;
- Command-R7B closes an answer with <|END_RESPONSE|><|END_OF_TURN_TOKEN|> (the EOS second), and only
  the first was trained;
- a short answer ("OK") was found inside a special token's name (Cohere's <|END_OF_TURN_TOKEN|>);
- GLM, StepFun and Ling render the reasoning of the last answer in their own spacing: it was left
  untrained in the prompt and the answer reported as "reasoning dropped";
- the tool-use templates (Hermes-3, Command-R+) failed every row with "'NoneType' object is not
  iterable", which says nothing about what to do;
- Command-R7B's default system turn is hundreds of tokens: with a short data.max_seq_len every row
  was refused as "no trained tokens", not as cut.
And `tunesmith train` end to end on GLM-4.6 and Command-R7B (CPU, 2 steps, `slow`).
The vocabularies of these families are stand-ins (families.py says which); the templates are theirs.
"""

from __future__ import annotations

import pytest

from engine.config import DataConfig
from engine.data.dataset import prepare_dataset
from engine.data.render import RowError, tokenize_example
from engine.data.sources import DataError
from tests.conformance.conversations import CONVERSATIONS
from tests.conformance.test_masks import trained_runs
from tests.conformance.test_rows import train_cli, write_rows

CORPUS = ["single", "system_single", "multi_turn", "reasoning_single", "reasoning_multi_turn", "code_answer"]


def trained_pieces(tok, t) -> list[str]:
    """Each run of trained tokens as text of what training tokenized."""
    enc = tok(t.text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == t.ids
    return [t.text[a:b] for a, b, _ in trained_runs(enc["offset_mapping"], t.trained)]


@pytest.mark.parametrize(
    "name, end",
    [
        ("glm-4.6", "<|user|>"),
        ("glm-4.7", "<|user|>"),
        ("apertus", "<|assistant_end|>"),
        ("hunyuan-3", "<｜hy_eos:opensource｜>"),
        ("apriel-1.6", "\n<|end|>"),
    ],
)
def test_the_last_answer_gets_the_end_token_the_template_leaves_off(name, end, family_tokenizer):
    tok = family_tokenizer(name)
    messages = CONVERSATIONS["multi_turn"]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith(messages[-1]["content"])  # the template's own render stops at the answer
    t = tokenize_example(tok, messages)
    assert t.text == rendered + end
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [p.lstrip() for p in trained_pieces(tok, t)] == [a + end for a in answers]
    assert [a.end_added for a in t.answers] == [False, False, True]


def test_a_newline_before_the_end_token_is_trained_with_it(family_tokenizer):
    tok = family_tokenizer("nemotron-nano-v2")
    t = tokenize_example(tok, CONVERSATIONS["system_multi_turn"])
    assert trained_pieces(tok, t) == [
        "It translates source code into machine code.\n<SPECIAL_12>",
        "It runs the source code directly, statement by statement.\n<SPECIAL_12>",
    ]
    assert all(a.ends_at_marker for a in t.answers)


@pytest.mark.parametrize("name, close", [("command-r7b", "<|END_RESPONSE|>"), ("command-a", "<|END_TEXT|>")])
def test_an_answer_closed_by_two_tokens_trains_both_up_to_the_eos(name, close, family_tokenizer):
    tok = family_tokenizer(name)
    assert tok.eos_token == "<|END_OF_TURN_TOKEN|>"
    t = tokenize_example(tok, CONVERSATIONS["single"])
    assert trained_pieces(tok, t) == ["Air scatters blue light more than red light." + close + tok.eos_token]


def test_an_answer_is_not_found_inside_a_special_tokens_name(family_tokenizer):
    # "OK" is in "<|END_OF_TURN_TOKEN|>", which the template writes before the answer.
    tok = family_tokenizer("command-a")
    t = tokenize_example(tok, CONVERSATIONS["answer_repeats_prompt"])
    assert trained_pieces(tok, t) == ["OK<|END_TEXT|><|END_OF_TURN_TOKEN|>"] * 2


@pytest.mark.parametrize(
    "name, shown",
    [
        ("glm-4.6", "<think>17 times 3 is 51.</think>\n17 × 3 = 51.<|user|>"),
        ("ling-3.0", "<think>17 times 3 is 51.</think>17 × 3 = 51.<|role_end|>"),
        ("stepfun-3.5", "<think>\n17 times 3 is 51.\n</think>\n17 × 3 = 51.<|im_end|>"),
    ],
)
def test_reasoning_the_template_renders_its_own_way_is_trained(name, shown, family_tokenizer):
    tok = family_tokenizer(name)
    t = tokenize_example(tok, CONVERSATIONS["reasoning_single"])
    assert [p.lstrip("\n") for p in trained_pieces(tok, t)] == [shown]
    assert not t.answers[0].reasoning_dropped


@pytest.mark.parametrize(
    "template, reads",
    [
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "tools"),
        ("CohereForAI-c4ai-command-r-plus-tool_use", "tools"),
        ("fireworks-ai-llama-3-firefunction-v2", "functions"),
    ],
)
def test_a_tool_use_template_is_refused_with_what_to_do(template, reads, family_folder):
    from transformers import AutoTokenizer

    from tests.conformance import upstream

    tok = AutoTokenizer.from_pretrained(family_folder("llama-3.1"))
    tok.chat_template = upstream.template(template)
    with pytest.raises(RowError) as err:
        tokenize_example(tok, CONVERSATIONS["single"])
    said = str(err.value)
    assert f"a tool-use chat template: it reads `{reads}`" in said and "default chat template" in said


def test_a_prompt_longer_than_max_seq_len_says_the_cut_removed_the_answers(tmp_path, family_tokenizer):
    tok = family_tokenizer("command-r7b")
    cfg = DataConfig(source=write_rows(tmp_path / "rows.jsonl", CORPUS), max_seq_len=128)
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, tok)
    said = str(err.value)
    assert "every row failed with: the cut at data.max_seq_len (128 tokens) removed every answer token" in said
    assert "raise data.max_seq_len" in said
    assert len(prepare_dataset(DataConfig(source=cfg.source, max_seq_len=1024), tok).docs) == len(CORPUS)


@pytest.mark.slow
@pytest.mark.parametrize("name, max_seq_len", [("glm-4.6", 128), ("command-r7b", 1024)])
def test_a_family_trains_from_the_command_line(tmp_path, family_folder, name, max_seq_len):
    log = train_cli(
        tmp_path, family_folder(name), write_rows(tmp_path / "rows.jsonl", CORPUS * 2), max_seq_len=max_seq_len
    )
    assert " skipped: " not in log  # every row trains (train_cli checks both steps ran and the run finished)
    # GLM drops earlier answers' reasoning as Qwen3 does; Command-R7B keeps it.
    assert ("drops the <think> reasoning of earlier answers in 2 rows" in log) == (name == "glm-4.6")


def test_a_preference_answer_gets_the_end_token_the_template_leaves_off(tmp_path, family_tokenizer):
    import json

    from engine.data.preference import prepare_preference_data

    tok = family_tokenizer("glm-4.6")
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Capital of Peru?", "chosen": "Lima.", "rejected": "Quito."}) + "\n")
    data = prepare_preference_data(DataConfig(source=str(path), max_seq_len=128), tok, "paired")
    _, chosen, rejected = data.examples[0]
    # What the conversation adds to the prompt (GLM's "\n<think></think>\n" opens the answer), then <|user|>.
    assert tok.decode(chosen).endswith("\nLima.<|user|>") and tok.decode(rejected).endswith("\nQuito.<|user|>")


def test_an_export_stops_on_the_end_token_training_added(family_tokenizer):
    # The merged export's generation_config and the Modelfile's stops take the template's end of turn.
    from engine.export.modelfile import stop_tokens
    from engine.export.selfcheck import turn_end_token

    tok = family_tokenizer("glm-4.6")
    assert tok.convert_ids_to_tokens(turn_end_token(tok)) == "<|user|>"
    assert stop_tokens(tok, []) == ["<|endoftext|>", "<|user|>"]


@pytest.mark.parametrize(
    "name, shown",
    [
        ("laguna-xs", "\nAir scatters blue light more than red light.\n</assistant>"),
        ("lfm2.5-moe", "Air scatters blue light more than red light.<|im_end|>"),
    ],
)
def test_generation_blocks_train_neither_the_prompts_header_nor_the_newline_after(name, shown, family_tokenizer):
    # Both templates mark answers with {% generation %}: Laguna's block opens with "<assistant>\n</think>",
    # which the generation prompt holds; both run on to the newline after the end-of-turn token.
    tok = family_tokenizer(name)
    assert "{%- generation -%}" in tok.chat_template
    t = tokenize_example(tok, CONVERSATIONS["single"])
    assert trained_pieces(tok, t) == [shown]
