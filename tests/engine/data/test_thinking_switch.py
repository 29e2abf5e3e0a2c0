"""data.thinking: the chat template's thinking switch, on real upstream templates
(tests/conformance/families.py). DeepSeek-V3.2's and V4's templates render an answer's reasoning
only with `thinking` on: then it is trained with its answer and end token, from the end of the
generation prompt (which holds the <think>), and nothing of another turn; off (their default) the
reasoning is reported dropped as before. Qwen3's reads `enable_thinking`: off, its generation prompt
(the chat's, the gallery's) holds the empty <think></think> its training render puts before an
answer, and only the answer is trained. "auto" is on when an answer carries a reasoning field; a run
records what it used. Kimi-K2-Thinking's template reads no switch at all."""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, DataConfig, RunConfig
from engine.data.dataset import prepare_dataset
from engine.data.formats import FormatSpec, row_to_messages
from engine.data.render import render, template_switches, thinking_vars, tokenize_example, tokenize_rows
from tests.conformance.families import build_family_folder

CONV = FormatSpec("conversations", {"messages": "messages"})
REASONING = "Air molecules scatter short wavelengths.\nBlue is short."
ANSWER = "Because air scatters blue light more than red light."
DS_END = "<｜end▁of▁sentence｜>"


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_family_folder(name)))


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    names = ("deepseek-v3.2", "deepseek-v4", "qwen3", "kimi-k2-thinking", "gpt-oss", "llama-3.1")
    return {name: _tokenizer(name) for name in names}


def _conversation(reasoning: bool = True, earlier: bool = False) -> list[dict]:
    answer = {"role": "assistant", "content": ANSWER}
    if reasoning:
        answer["reasoning_content"] = REASONING
    head = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}] if earlier else []
    return row_to_messages({"messages": head + [{"role": "user", "content": "Why is the sky blue?"}, answer]}, CONV)


def _trained_text(tok, t) -> str:
    return tok.decode([i for i, m in zip(t.ids, t.trained) if m])


def test_the_switches_are_read_from_each_templates_source(tokenizers):
    assert template_switches(tokenizers["deepseek-v3.2"].chat_template) == ("thinking", "enable_thinking")
    assert template_switches(tokenizers["deepseek-v4"].chat_template) == ("thinking", "enable_thinking")
    assert template_switches(tokenizers["qwen3"].chat_template) == ("enable_thinking",)
    # gpt-oss reads a message's `thinking` field, not a variable; Kimi-K2-Thinking and Llama read none.
    for name in ("gpt-oss", "kimi-k2-thinking", "llama-3.1"):
        assert template_switches(tokenizers[name].chat_template) == ()
        assert thinking_vars(tokenizers[name], True) == {}
    assert thinking_vars(tokenizers["qwen3"], False) == {"enable_thinking": False}
    assert thinking_vars(tokenizers["qwen3"], "auto") == thinking_vars(tokenizers["qwen3"], None) == {}


@pytest.mark.parametrize("family", ["deepseek-v3.2", "deepseek-v4"])
def test_deepseek_with_thinking_on_trains_the_reasoning_from_the_prompts_end(tokenizers, family):
    tok = tokenizers[family]
    messages = _conversation(earlier=True)
    got = tokenize_example(tok, messages, thinking=True)
    assert REASONING in got.text and not any(a.reasoning_dropped for a in got.answers)
    # The generation prompt of the conversation before the answer ends with "<think>": the model
    # writes the reasoning, "</think>", the answer and the end token, and exactly those are trained
    # (with the earlier answer and its end token), no question and no "<think>".
    prompt = render(tok, messages[:3], generation_prompt=True, thinking=True)[0]
    assert prompt.endswith("<｜Assistant｜><think>") and got.text.startswith(prompt)
    assert _trained_text(tok, got) == "Hi." + DS_END + REASONING + "</think>" + ANSWER + DS_END
    tail = tokenize_example(tok, messages, thinking=True, responses_only=False)
    first = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert tail.ids == got.ids and all(got.trained[first:]) and not any(got.trained[first - 3 : first])


@pytest.mark.parametrize("thinking", [False, None])
def test_deepseek_with_thinking_off_reports_the_reasoning_dropped(tokenizers, thinking):
    tok = tokenizers["deepseek-v3.2"]
    got = tokenize_example(tok, _conversation(), thinking=thinking)
    assert REASONING not in got.text and got.answers[0].reasoning_dropped
    assert _trained_text(tok, got) == ANSWER + DS_END


def test_deepseek_keep_with_thinking_on_trains_every_answers_reasoning(tokenizers):
    # With thinking on, DeepSeek-V3.2 renders only the reasoning after the last question: an earlier
    # answer's is dropped from the history, and earlier_reasoning "keep" gives it its own example.
    tok = tokenizers["deepseek-v3.2"]
    first = {"role": "assistant", "content": "Hi.", "reasoning_content": "A greeting."}
    messages = row_to_messages({"messages": [{"role": "user", "content": "Hello there."}, first]}, CONV)
    messages += _conversation()
    (parts,) = tokenize_rows(tok, [messages], earlier_reasoning="keep", thinking=True)
    assert [_trained_text(tok, p) for p in parts] == [
        "A greeting.</think>Hi." + DS_END,
        REASONING + "</think>" + ANSWER + DS_END,
    ]


def test_qwen3_off_puts_the_empty_think_block_in_the_prompt_and_trains_the_answer_only(tokenizers):
    from engine.train.evaluation import encode_prompt

    tok = tokenizers["qwen3"]
    got = tokenize_example(tok, _conversation(reasoning=False), thinking=False)
    assert "<think>\n\n</think>\n\n" + ANSWER in got.text
    assert _trained_text(tok, got) == ANSWER + "<|im_end|>"
    prompt = render(tok, _conversation(reasoning=False)[:1], generation_prompt=True, thinking=False)[0]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and got.text.startswith(prompt)
    # The gallery's and the chat's prompts open the answer the same way (engine.chat renders alike).
    assert tok.decode(encode_prompt(tok, "Why is the sky blue?", True, False)).endswith("<think>\n\n</think>\n\n")
    assert not tok.decode(encode_prompt(tok, "Why is the sky blue?", True, "auto")).endswith("</think>\n\n")


def _write(path, conversations: list[list[dict]]) -> str:
    rows = [{"messages": [{k: v for k, v in m.items() if k != "reasoning_field"} for m in c]} for c in conversations]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_auto_is_on_when_an_answer_carries_a_reasoning_field(tmp_path, tokenizers):
    from engine.train.data_setup import record_thinking

    tok = tokenizers["deepseek-v3.2"]
    source = _write(tmp_path / "r.jsonl", [_conversation(reasoning=False), _conversation()])
    data = prepare_dataset(DataConfig(source=source), tok)
    assert data.thinking is True and "thinking=true" in data.thinking_said and not data.notes
    assert REASONING in tok.decode([i for i, m in zip(data.docs[1], data.trained[1]) if m])
    config = RunConfig.from_dict({"data": {"source": source}})
    record_thinking(config, data.thinking)
    assert config.data.thinking is True and "data.thinking" in config.auto_fields
    assert RunConfig.from_dict(config.to_dict()).data.thinking is True  # what config.yaml keeps

    off = prepare_dataset(DataConfig(source=source, thinking=False), tok)
    assert off.thinking is False and "drops the <think> reasoning" in off.notes[0]
    plain = prepare_dataset(DataConfig(source=_write(tmp_path / "p.jsonl", [_conversation(reasoning=False)])), tok)
    assert plain.thinking is None and plain.thinking_said == ""
    config = RunConfig.from_dict({"data": {"source": source}})
    record_thinking(config, plain.thinking)
    assert config.data.thinking == "auto" and "data.thinking" not in config.auto_fields


def test_the_xray_and_the_preview_render_with_the_switch(tmp_path, tokenizers):
    from engine.data.preview import render_example
    from engine.data.xray import xray

    tok = tokenizers["deepseek-v3.2"]
    source = _write(tmp_path / "r.jsonl", [_conversation()])
    assert not any(f.kind == "reasoning_dropped" for f in xray(DataConfig(source=source), tok).findings)
    assert any(f.kind == "reasoning_dropped" for f in xray(DataConfig(source=source, thinking=False), tok).findings)
    shown = render_example(tok, DataConfig(source=source), 0)
    assert "".join(p for p, t in shown.pieces if t) == REASONING + "</think>" + ANSWER + DS_END


def test_config_reads_on_off_and_names_the_field_of_a_bad_value(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  thinking: off\n", encoding="utf-8")
    assert RunConfig.load(path).data.thinking is False
    path.write_text("data:\n  thinking: on\n", encoding="utf-8")
    assert RunConfig.load(path).data.thinking is True
    assert RunConfig.from_dict({}).data.thinking == "auto"
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"data": {"thinking": "maybe"}})
    assert err.value.path == "data.thinking" and "'auto'" in str(err.value) and "true or false" in str(err.value)


@pytest.mark.slow
def test_tunesmith_train_reads_the_switch_from_the_yaml_and_records_it(tmp_path):
    # Qwen3's tiny folder (DeepSeek-V3's tiny one does not train on the CPU: an attention shape error
    # in the model, before and apart from the data): `thinking: off` is YAML for false.
    import subprocess
    import sys

    source = _write(tmp_path / "r.jsonl", [_conversation(reasoning=False)] * 4)
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{name_or_path: '{build_family_folder('qwen3')}', dtype: float32, load_in_4bit: false}}\n"
        "lora: {r: 4, alpha: 8}\n"
        f"data: {{source: '{source}', max_seq_len: 128, eval_fraction: 0, thinking: off}}\n"
        "training: {max_steps: 2, rows_per_micro_batch: 2, lr: 0.001, device: cpu}\n",
        encoding="utf-8",
    )
    out = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(path), "--output", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "renders with enable_thinking=false (data.thinking)" in out.stdout + out.stderr
    recorded = RunConfig.load(tmp_path / "run" / "config.yaml")
    assert recorded.data.thinking is False and "data.thinking" not in recorded.auto_fields


def test_preference_pairs_render_with_the_switch(tmp_path, tokenizers):
    from engine.data.preference import prepare_preference_data

    tok = tokenizers["deepseek-v3.2"]
    prompt = [{"role": "user", "content": "Why is the sky blue?"}]
    chosen = [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}]
    rows = [{"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": "It is not."}]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    on = prepare_preference_data(DataConfig(source=str(path), max_seq_len=256), tok, "paired")
    assert on.thinking is True
    (p, c, r) = on.examples[0]
    assert (
        tok.decode(p).endswith("<｜Assistant｜><think>") and tok.decode(c) == REASONING + "</think>" + ANSWER + DS_END
    )
    # Off (the template's default), DeepSeek-V3.2's prompt ends "<think></think>" but its answers render
    # after a bare "</think>": the prompt is no prefix of the conversation, and the pair is refused.
    from engine.data.sources import DataError

    with pytest.raises(DataError, match="does not render the prompt as a prefix"):
        prepare_preference_data(DataConfig(source=str(path), max_seq_len=256, thinking=False), tok, "paired")
