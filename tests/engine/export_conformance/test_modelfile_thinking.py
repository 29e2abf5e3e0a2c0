"""The Modelfile's TEMPLATE carries the run's thinking switch (data.thinking): translated with it, and
rendered by Go's own text/template (render_modelfile.go, `go run`), each prompt Ollama renders is the
official template's render with the same switch: Qwen3 off opens the answer with the empty
<think></think> its training render put before the answer; DeepSeek-V3.2 on opens it with <think>.
Go comes from the Debian package golang-go; without it the test skips (fails in CI)."""

from __future__ import annotations

import json
import subprocess

import pytest

from engine.data.render import thinking_vars
from engine.export import modelfile
from tests.conformance.families import build_family_folder
from tests.engine.export_conformance.test_modelfile_go import RENDERER, _go

CONVERSATION = [
    {"role": "user", "content": "Why is the sky blue?"},
    {"role": "assistant", "content": "Air scatters blue light most."},
    {"role": "user", "content": "And at sunset?"},
]


@pytest.mark.parametrize(
    ("family", "thinking", "opening"),
    [
        ("qwen3", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("deepseek-v3.2", True, "<｜Assistant｜><think>"),
    ],
)
def test_the_modelfile_renders_prompts_with_the_runs_thinking_switch(family, thinking, opening):
    from transformers import AutoTokenizer

    go = _go()
    tok = AutoTokenizer.from_pretrained(str(build_family_folder(family)))
    tr = modelfile.translate(tok, thinking=thinking)
    assert tr.template is not None, tr.reason
    prompts = [CONVERSATION[:1], CONVERSATION]
    cases = [{"template": tr.template, "messages": p} for p in prompts]
    done = subprocess.run(
        [go, "run", str(RENDERER)], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    switch = thinking_vars(tok, thinking)
    for prompt, got in zip(prompts, json.loads(done.stdout), strict=True):
        want = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **switch)
        assert got == want and got.endswith(opening)
    # The template's default differs: the switch is what the translation carries.
    assert modelfile.translate(tok).template != tr.template
