"""The Modelfile's TEMPLATE of every family of the conformance suite (tests/conformance/), rendered
by Go's own text/template with Ollama's data (render_modelfile.go, run with `go run`), against the
family's official chat template rendered by transformers: every prompt Ollama would render before
an answer (each prefix of each corpus conversation that ends with a user turn, system prompts,
several turns, reasoning in the history) and the translation's own checks (padded contents), with
the BOS written in the template and with it left to llama.cpp.

Go comes from the Debian package golang-go. Without it the test skips, except in CI (CI=true),
where it fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.export import modelfile
from tests.conformance.conversations import CONVERSATIONS, REASONING
from tests.conformance.families import EXPORT_FAMILIES, FAMILIES, build_family_folder

RENDERER = Path(__file__).with_name("render_modelfile.go")
# Where each family's template puts the system prompt, when not in a turn of its own ("joined": the
# template refuses system messages, so it opens the first user message, as training folds it).
SYSTEM_PLACE = {
    "mistral-v0.2": "joined",
    "mistral-v1": "first_user",
    "mistral-v3": "last_user",
    "mistral-tekken": "last_user",
    "gemma-2": "joined",
}


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        message = "Go is not installed (Debian: apt-get install golang-go); the Modelfile check needs text/template"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return go


def prompts(conversation: list[dict]) -> list[list[dict]]:
    """What Ollama renders before each answer: every prefix that ends with a user turn."""
    return [conversation[: i + 1] for i, m in enumerate(conversation) if m["role"] == "user"]


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_family_folder(name)))


@pytest.fixture(scope="module")
def rendered() -> dict:
    """family -> {"reason": why not translated} or {"cases": [(label, messages, Go's render, HF's
    render)], ...}, all rendered by one `go run`."""
    go = _go()
    out: dict = {}
    cases, where = [], []
    for name in EXPORT_FAMILIES:
        fam, tok = FAMILIES[name], _tokenizer(name)
        # Every corpus conversation the template understands, system prompts included: a template
        # without a system turn (Gemma-2) gets the system prompt joined to the first user message.
        convs = [c for k, c in CONVERSATIONS.items() if fam.reasoning or k not in REASONING] + modelfile.checks()
        for adds_bos in (False, True):
            tr = modelfile.translate(tok, runtime_adds_bos=adds_bos)
            if tr.template is None:
                out[name] = {"reason": tr.reason}
                break
            out.setdefault(name, {"cases": [], "system": tr.shape.system})
            for conv in convs:
                for prompt in prompts(conv):
                    given = modelfile.fold_system(prompt) if tr.shape.system == "joined" else prompt
                    try:
                        want = tok.apply_chat_template(given, tokenize=False, add_generation_prompt=True)
                    except Exception:  # the template refuses it (Gemma-2 and a system prompt): not a prompt
                        continue
                    assert want.startswith(tr.bos_dropped)
                    cases.append({"template": tr.template, "messages": prompt})
                    label = f"BOS in the template: {not adds_bos}; {len(prompt)} messages"
                    where.append((name, label, prompt, want[len(tr.bos_dropped) :]))
    done = subprocess.run(
        [go, "run", str(RENDERER)], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for (name, label, prompt, want), got in zip(where, json.loads(done.stdout), strict=True):
        out[name]["cases"].append((label, prompt, got, want))
    return out


@pytest.mark.parametrize("name", EXPORT_FAMILIES)
def test_the_modelfile_renders_every_prompt_as_the_hf_template(rendered, name):
    fam = FAMILIES[name]
    result = rendered[name]
    assert "reason" not in result, f"{name}: no TEMPLATE ({result.get('reason')})"
    cases = result["cases"]
    wrong = [case for case in cases if case[2] != case[3]]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} prompts differ; first: {wrong[0]}"
    # The prompts cover what they must: a system prompt (kept by every family: Gemma-2's joins the
    # first user message), several turns, and for reasoning families <think> blocks in the history.
    assert result["system"] == SYSTEM_PLACE.get(name, "turn")
    assert any("You are a terse geography tutor." in got for _, _, got, _ in cases)
    assert any(sum(m["role"] == "assistant" for m in msgs) >= 2 for _, msgs, _, _ in cases)
    if fam.reasoning:
        assert any(any("</think>" in m["content"] for m in msgs[:-1]) for _, msgs, _, _ in cases)


def test_go_renders_ollamas_data_as_ollama_does():
    """The renderer's own data shape: .System joins the system messages, .Messages merges
    consecutive turns of one role (Ollama's collate), .Prompt is empty; Python's mirror agrees."""
    go = _go()
    template = (
        "{{ .System }}|{{ range $i, $m := .Messages }}{{ $i }}:{{ .Role }}={{ .Content }};{{ end }}|{{ .Prompt }}"
    )
    msgs = [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "q1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a"},
    ]
    done = subprocess.run(
        [go, "run", str(RENDERER)],
        input=json.dumps([{"template": template, "messages": msgs}]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["A\n\nB|0:system=A\n\nB;1:user=q1\n\nq2;2:assistant=a;|"]
    assert modelfile.ollama_collate(msgs) == (
        "A\n\nB",
        [
            {"role": "system", "content": "A\n\nB"},
            {"role": "user", "content": "q1\n\nq2"},
            {"role": "assistant", "content": "a"},
        ],
    )
