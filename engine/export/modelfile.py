"""An Ollama `Modelfile` for a GGUF export: FROM the GGUF beside it, the chat template translated
from the tokenizer's Jinja template into Ollama's Go template, the stop tokens, and the
generation parameters of the run's generation_config. Ollama is not needed to write it.

The translation does not parse Jinja. It renders conversations through the tokenizer's own
template with marker contents and reads off the parts of one fixed shape (`Shape`), the shape
the chat templates of the families Tunesmith checks share (Qwen, Llama-3.x, Phi, Mistral,
Gemma, SmolLM, DeepSeek-R1 distills, GPT-OSS, Granite):

- the BOS text, and the block before the first message when there is no system message (a
  default system prompt, Llama-3.x's dated header, or nothing);
- the system message as a turn of its own, or folded into the first (Gemma-3, Mistral v1) or the
  last (Mistral v3) user turn, or not rendered at all;
- the text before and after each user and assistant message, and the generation prompt;
- what the template does to each message's content: kept, trimmed (`| trim`), its leading
  newlines dropped, or (reasoning models) only the answer after the last `</think>` kept in the
  history (`CONTENT_RULES`).

The Go template written from these parts uses only Go's own text/template (Ollama adds no string
functions): trimming and the `</think>` cut are small recursive `define` blocks over `slice`,
`len` and `eq`. `Shape.render` renders the same shape in Python, with Ollama's data (`.System`
is every system message joined, consecutive messages of one role merged), and the translation is
kept only when it renders every conversation of `checks()` (system prompts, several turns,
padded contents, reasoning in the history) exactly as the tokenizer's template does. Otherwise
the Modelfile has no TEMPLATE line and says why. tests/engine/export_conformance/ renders the
written templates with Go's real text/template (render_modelfile.go) against the HF template."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from engine.data.render import SYSTEM_JOIN, fold_system_message, thinking_vars

_MARK = "\x02{}\x03"  # marker contents no template changes
_WS = " \t\n\r\v\f"  # what trimming removes, here and in the Go template (ASCII whitespace)
_THINK_END = "</think>"


# -- what a template does to a message's content ----------------------------------------------
def _after_think(text: str) -> str:
    return text.split(_THINK_END)[-1] if _THINK_END in text else text


# Tried in this order; the first that explains every probe is the rule of that slot.
CONTENT_RULES: dict[str, Callable[[str], str]] = {
    "keep": lambda s: s,
    "trim": lambda s: s.strip(_WS),
    "rstrip": lambda s: s.rstrip(_WS),
    "lstrip_newlines": lambda s: s.lstrip("\n"),
    "answer_only": _after_think,
    "answer_only_lstrip_newlines": lambda s: _after_think(s).lstrip("\n") if _THINK_END in s else s,
}

_TAIL = "(slice . (len (slice . 1)))"  # the last byte of the string
_HEAD = "(slice . 0 (len (slice . 1)))"  # all but the last byte
_ENDS_THINK = f'(and (ge (len .) {len(_THINK_END)}) (eq (slice . (len (slice . {len(_THINK_END)}))) "{_THINK_END}"))'


def _is_ws(byte: str) -> str:
    return "(or " + " ".join(f"(eq {byte} {json.dumps(c)})" for c in _WS) + ")"


def _go(text: str) -> str:
    """Go template text written with shorthands: HEAD, TAIL, ENDS_THINK, WS(TAIL), WS(FIRST)."""
    text = text.replace("WS(TAIL)", _is_ws(_TAIL)).replace("WS(FIRST)", _is_ws("(slice . 0 1)"))
    return text.replace("ENDS_THINK", _ENDS_THINK).replace("HEAD", _HEAD).replace("TAIL", _TAIL)


# Go text/template blocks, each rendering its string argument; `and` stops at its first false
# argument (Go 1.18+), so no slice runs out of range.
_DEFINES = {
    "ts_rtrim": _go('{{ if and (gt (len .) 0) WS(TAIL) }}{{ template "ts_rtrim" HEAD }}{{ else }}{{ . }}{{ end }}'),
    "ts_trim": _go(
        '{{ if and (gt (len .) 0) WS(FIRST) }}{{ template "ts_trim" (slice . 1) }}{{ else }}{{ template "ts_rtrim" . }}'
        "{{ end }}"
    ),
    "ts_lstrip_nl": _go(
        '{{ if and (gt (len .) 0) (eq (slice . 0 1) "\\n") }}{{ template "ts_lstrip_nl" (slice . 1) }}'
        "{{ else }}{{ . }}{{ end }}"
    ),
    # After the last </think>: walk back from the end; the bytes are written as the calls return.
    "ts_answer": _go('{{ if ENDS_THINK }}{{ else if gt (len .) 0 }}{{ template "ts_answer" HEAD }}{{ TAIL }}{{ end }}'),
    # The same, without the newlines right after the last </think>.
    "ts_answer_nl": _go(
        '{{ if ENDS_THINK }}{{ else if gt (len .) 0 }}{{ template "ts_answer_nl" HEAD }}'
        '{{ if eq TAIL "\\n" }}{{ template "ts_nl" HEAD }}{{ else }}{{ TAIL }}{{ end }}{{ end }}'
    ),
    # A newline whose text before it is (</think> then newlines): dropped; else written.
    "ts_nl": _go(
        '{{ if ENDS_THINK }}{{ else if and (gt (len .) 0) (eq TAIL "\\n") }}{{ template "ts_nl" HEAD }}'
        '{{ else }}{{ "\\n" }}{{ end }}'
    ),
}
_GO_RULES = {  # rule -> (Go expression of a string value X, define blocks it needs)
    "keep": ("{{ X }}", ()),
    "trim": ('{{ template "ts_trim" X }}', ("ts_rtrim", "ts_trim")),
    "rstrip": ('{{ template "ts_rtrim" X }}', ("ts_rtrim",)),
    "lstrip_newlines": ('{{ template "ts_lstrip_nl" X }}', ("ts_lstrip_nl",)),
    "answer_only": ('{{ template "ts_answer" X }}', ("ts_answer",)),
    "answer_only_lstrip_newlines": ('{{ template "ts_answer_nl" X }}', ("ts_answer_nl", "ts_nl")),
}


# -- the shape -------------------------------------------------------------------------------
@dataclass
class Shape:
    """The parts of a chat template, read off its renders (see the module docstring)."""

    bos: str
    no_system: str  # before the first message when there is no system message
    user: tuple[str, str]
    assistant: tuple[str, str]
    gen: str  # the generation prompt
    # "turn" | "first_user" | "last_user" | "none" | "joined" (the template refuses system messages:
    # the system prompt joins the first user message's content, JOIN between, as training folds it)
    system: str = "turn"
    system_parts: tuple[str, str] = ("", "")  # around the system text (a turn, or inside the user turn)
    rules: dict = field(default_factory=lambda: {"user": "keep", "assistant": "keep", "system": "keep"})

    def render(self, messages: list[dict], with_bos: bool = True) -> str:
        """The prompt Ollama renders from this shape's Go template: `messages` collated as Ollama
        does, then the generation prompt."""
        system, msgs = ollama_collate(messages)
        rule = {k: CONTENT_RULES[v] for k, v in self.rules.items()}
        out = [self.bos if with_bos else ""]
        if self.system == "turn" and system:
            out.append(self.system_parts[0] + rule["system"](system) + self.system_parts[1])
        else:
            out.append(self.no_system)
        folded = system if self.system in ("first_user", "last_user", "joined") else ""
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                out.append(self.user[0])
                content = m["content"]
                if folded and self.system == "joined":
                    content, folded = folded + JOIN + content, ""
                elif folded and (self.system == "first_user" or i == len(msgs) - 1):
                    out.append(self.system_parts[0] + rule["system"](folded) + self.system_parts[1])
                    folded = ""
                out.append(rule["user"](content) + self.user[1])
            elif m["role"] == "assistant":
                out.append(self.assistant[0] + rule["assistant"](m["content"]) + self.assistant[1])
        out.append(self.gen)
        return "".join(out)

    def go_template(self, with_bos: bool = True) -> str:
        """The same as an Ollama (Go text/template) TEMPLATE."""
        needed: list[str] = []

        def content(slot: str, value: str) -> str:
            expr, defines = _GO_RULES[self.rules[slot]]
            needed.extend(d for d in defines if d not in needed)
            return expr.replace("X", value)

        system = content("system", "$.System")
        fold = ""
        if self.system == "turn":
            head = "{{ if .System }}" + _lit(self.system_parts[0]) + system + _lit(self.system_parts[1])
            head += "{{ else }}" + _lit(self.no_system) + "{{ end }}"
        else:
            head = _lit(self.no_system)
            if self.system == "joined":
                joined = content("user", f"(print $folded {json.dumps(JOIN)} .Content)")
                fold = "{{ if $folded }}" + joined + '{{ $folded = "" }}{{ else }}'
            elif self.system != "none":
                when = "$folded" if self.system == "first_user" else "and $folded $last"
                fold = "{{ if " + when + " }}" + _lit(self.system_parts[0]) + system
                fold += _lit(self.system_parts[1]) + '{{ $folded = "" }}{{ end }}'
        body = (
            "{{ $folded := .System }}{{ range $i, $_ := .Messages }}"
            "{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            '{{ if eq .Role "user" }}'
            + _lit(self.user[0])
            + fold
            + content("user", ".Content")
            + ("{{ end }}" if self.system == "joined" else "")
            + _lit(self.user[1])
            + '{{ else if eq .Role "assistant" }}'
            + _lit(self.assistant[0])
            + content("assistant", ".Content")
            + _lit(self.assistant[1])
            + "{{ end }}{{ end }}"
            + _lit(self.gen)
        )
        if self.system != "last_user":  # only the fold into the last user turn asks which message is last
            body = body.replace("{{ $last := eq (len (slice $.Messages $i)) 1 }}", "")
        defines = "".join(f'{{{{ define "{name}" }}}}{_DEFINES[name]}{{{{ end }}}}' for name in needed)
        return defines + (_lit(self.bos) if with_bos else "") + head + body


def ollama_collate(messages: list[dict]) -> tuple[str, list[dict]]:
    """What Ollama's template sees: `.System` (every system message, joined by a blank line) and
    `.Messages` (consecutive messages of one role merged with a blank line)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return system, out


def _lit(text: str) -> str:
    """Literal template text; a '{{' inside it is written as a Go string action."""
    return text.replace("{{", '{{ "{{" }}')


# -- reading a template's shape --------------------------------------------------------------
def _render(tokenizer, messages, gen=True, thinking=None) -> str:
    """The template's render, with the run's thinking switch (data.thinking) as training gave it."""
    switch = thinking_vars(tokenizer, thinking)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **switch)


def _msgs(*roles: str) -> list[dict]:
    return [{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)]


def _split(text: str, n: int) -> Optional[list[str]]:
    """The text around markers 0..n-1 (n + 1 pieces), or None when a marker is missing or repeated."""
    pieces, rest = [], text
    for i in range(n):
        mark = _MARK.format(i)
        if rest.count(mark) != 1:
            return None
        head, rest = rest.split(mark, 1)
        pieces.append(head)
    return pieces + [rest]


class _NoShape(ValueError):
    """The template does not have the shape; the message says where it differs."""


def _tail_after(tokenizer, text: str, follow: str) -> str:
    """The end of a turn: `text` (what a template renders after the last message when it adds no
    generation prompt) where the next turn (`follow`) starts with it, else without the EOS some
    templates add at the very end, else (a template that always adds a generation prompt) the
    part `follow` shares with it."""
    eos = tokenizer.eos_token or ""
    if follow.startswith(text):
        return text
    if eos and text.endswith(eos) and follow.startswith(text[: -len(eos)]):
        return text[: -len(eos)]
    return os.path.commonprefix([text, follow])


def read_shape(tokenizer, thinking=None) -> Shape:
    """The template's parts, from renders with marker contents (and the run's thinking switch);
    _NoShape when it has another shape."""
    one = _split(_render(tokenizer, _msgs("user"), thinking=thinking), 1)
    three = _split(_render(tokenizer, _msgs("user", "assistant", "user"), thinking=thinking), 3)
    if one is None or three is None:
        raise _NoShape("the template changes or drops message contents")
    bos = tokenizer.bos_token or ""
    bos = bos if bos and one[0].startswith(bos) else ""
    start, end = one[0][len(bos) :], one[1]
    if three[0] != one[0] or three[3] != end:
        raise _NoShape("the template renders the first or last turn differently in a longer conversation")
    user_end = _tail_after(tokenizer, _split(_render(tokenizer, _msgs("user"), False, thinking), 1)[1], three[1])
    assistant_end = _tail_after(
        tokenizer, _split(_render(tokenizer, _msgs("user", "assistant"), False, thinking), 2)[2], three[2]
    )
    user_start = three[2][len(assistant_end) :]
    if not start.endswith(user_start) or not end.startswith(user_end):
        raise _NoShape("the template does not render each message on its own (it depends on the turn)")
    shape = Shape(
        bos=bos,
        no_system=start[: len(start) - len(user_start)],
        user=(user_start, user_end),
        assistant=(three[1][len(user_end) :], assistant_end),
        gen=end[len(user_end) :],
    )
    _read_system(tokenizer, shape, thinking)
    _read_rules(tokenizer, shape, thinking)
    return shape


def _read_system(tokenizer, s: Shape, thinking=None) -> None:
    try:
        text = _render(tokenizer, _msgs("system", "user"), thinking=thinking)
        text4 = _render(tokenizer, _msgs("system", "user", "assistant", "user"), thinking=thinking)
    except Exception:  # templates that refuse a system message (Gemma-2) raise on purpose
        s.system = "joined"
        return
    if _MARK.format(0) not in text:
        s.system = "none"  # the template drops it
        return
    two = _split(text, 2)
    at = [text4.find(_MARK.format(i)) if text4.count(_MARK.format(i)) == 1 else -1 for i in range(4)]
    if two is None or -1 in at:
        raise _NoShape("the template renders the system message more than once")
    lead = s.bos + s.no_system + s.user[0]
    if two[0].startswith(s.bos) and two[1].endswith(s.user[0]) and not two[0].startswith(lead):
        s.system = "turn"
        s.system_parts = (two[0][len(s.bos) :], two[1][: len(two[1]) - len(s.user[0])])
        return
    end = [a + len(_MARK.format(i)) for i, a in enumerate(at)]
    # Folded into the first user turn, before its content (Gemma-3, Mistral v1).
    if at == sorted(at) and text4[: at[0]].startswith(lead):
        s.system, s.system_parts = "first_user", (text4[len(lead) : at[0]], text4[end[0] : at[1]])
        return
    # Folded into the last user turn (Mistral v3: [INST] system\n\nquestion[/INST]).
    head = s.assistant[1] + s.user[0]
    if at[2] < at[0] < at[3] and text4[end[2] : at[0]].startswith(head):
        s.system, s.system_parts = "last_user", (text4[end[2] + len(head) : at[0]], text4[end[0] : at[3]])
        return
    raise _NoShape("the template puts the system message somewhere this translation does not handle")


# Contents that show what a template does to a message: padded with whitespace, and (for an
# answer in the history) with reasoning before it.
_PROBES = {
    "user": ["\n \n" + _MARK.format(0) + " \n\n", " " + _MARK.format(0) + "\n"],
    "system": ["\n \n" + _MARK.format(0) + " \n\n", " " + _MARK.format(0) + "\n"],
    "assistant": [
        "\n \n" + _MARK.format(1) + " \n\n",
        "<think>\nR\n</think>\n\n" + _MARK.format(1) + "\n",
        "<think>\nR\n</think>" + _MARK.format(1),
    ],
}


def _read_rules(tokenizer, s: Shape, thinking=None) -> None:
    for slot, probes in _PROBES.items():
        if slot == "system" and s.system in ("none", "joined"):
            continue
        seen = [(probe, _render(tokenizer, _probe_messages(slot, probe), thinking=thinking)) for probe in probes]
        for name in CONTENT_RULES:
            trial = Shape(**{**s.__dict__, "rules": {**s.rules, slot: name}})
            if all(trial.render(_probe_messages(slot, p)) == text for p, text in seen):
                s.rules[slot] = name
                break
        else:
            raise _NoShape(f"the template changes {slot} messages in a way this translation does not handle")


def _probe_messages(slot: str, probe: str) -> list[dict]:
    if slot == "user":
        return [{"role": "user", "content": probe}]
    if slot == "system":
        return [{"role": "system", "content": probe}, {"role": "user", "content": _MARK.format(1)}]
    return [
        {"role": "user", "content": _MARK.format(0)},
        {"role": "assistant", "content": probe},
        {"role": "user", "content": _MARK.format(2)},
    ]


# -- checking a translation --------------------------------------------------------------------
# The fold that training applies to a template without a system turn (one home: engine.data.render).
JOIN = SYSTEM_JOIN
fold_system = fold_system_message


def checks(system: bool = True) -> list[list[dict]]:
    """The conversations a translation must render exactly as the tokenizer's template does:
    one and several turns, with and without a system prompt, padded contents, and answers with
    their reasoning in the history."""
    q1, q2, q3 = "What is 2 plus 2?", "  And 3 plus 3?\n", "Why?"
    a1 = "Answer: 4"
    reasoned = "<think>\nAdd them.\n</think>\n\nAnswer: 6"
    convs = [
        [{"role": "user", "content": q1}],
        [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}],
        [
            {"role": "user", "content": "\n" + q1},
            {"role": "assistant", "content": " " + a1 + "\n"},
            {"role": "user", "content": q2},
            {"role": "assistant", "content": reasoned},
            {"role": "user", "content": q3},
        ],
    ]
    if system:
        sys = {"role": "system", "content": "Be brief. Answer with a number."}
        convs += [[sys] + convs[0], [sys] + convs[1], [{"role": "system", "content": " Be brief.\n"}] + convs[2]]
    return convs


@dataclass
class Translation:
    template: Optional[str]  # the Go template, or None when the Jinja template cannot be translated
    reason: str = ""  # why not, one sentence
    bos_dropped: str = ""  # the BOS text left out because the runtime adds it
    system: bool = True  # system messages are rendered
    shape: Optional[Shape] = None
    notes: list[str] = field(default_factory=list)  # comments for the Modelfile

    def render(self, messages: list[dict]) -> str:
        """The prompt the TEMPLATE renders for `messages` (with the BOS it writes, if any)."""
        return self.shape.render(messages, with_bos=not self.bos_dropped)


def translate(tokenizer, runtime_adds_bos: bool = False, thinking=None) -> Translation:
    """The tokenizer's chat template as an Ollama Go template, checked on the `checks()`
    conversations. `runtime_adds_bos`: llama.cpp adds the BOS token itself, so the template
    leaves out a literal one (two BOS tokens otherwise). `thinking`: the run's data.thinking, so
    the Go template renders what training rendered (Qwen3 off: the empty <think></think> opening
    each answer)."""
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        return Translation(None, "the tokenizer has no chat template")
    try:
        shape = read_shape(tokenizer, thinking)
    except _NoShape as exc:
        return Translation(None, str(exc))
    except Exception as exc:  # a template can raise on purpose; that is its answer
        return Translation(None, f"the template cannot render a plain user/assistant conversation ({exc})")
    for msgs in checks(system=shape.system != "none"):
        try:
            want = _render(tokenizer, fold_system(msgs) if shape.system == "joined" else msgs, thinking=thinking)
        except Exception:  # a conversation this template refuses is not one Ollama must render
            continue
        if shape.render(msgs) != want:
            kind = "with a system prompt" if msgs[0]["role"] == "system" else "without a system prompt"
            return Translation(
                None,
                f"the translation renders a {len(msgs)}-message conversation {kind} differently from the template",
            )
    notes = []
    if shape.system == "none":
        notes.append("The chat template drops system messages: they are not rendered.")
    elif shape.system == "joined":
        notes.append("The chat template has no system turn: the system prompt opens the first user message.")
    elif shape.system != "turn":
        notes.append(
            f"The system prompt is folded into the {shape.system.replace('_', ' ')} turn, as the template does."
        )
    if "strftime_now" in source:
        notes.append("The template writes today's date; the date of this export is written here instead.")
    if "answer" in shape.rules["assistant"]:
        notes.append("Earlier answers keep only the text after </think>, as the template renders the history.")
    drop = runtime_adds_bos and bool(shape.bos)
    return Translation(
        shape.go_template(with_bos=not drop),
        bos_dropped=shape.bos if drop else "",
        system=shape.system != "none",
        shape=shape,
        notes=notes,
    )


# -- the rest of the Modelfile -----------------------------------------------------------------
def stop_tokens(tokenizer, gen_eos: list[int]) -> list[str]:
    """The strings Ollama stops on: the EOS, the token that ends an assistant turn, and every
    eos_token_id of generation_config."""
    from engine.export.selfcheck import turn_end_token

    ids = [i for i in [tokenizer.eos_token_id, turn_end_token(tokenizer), *gen_eos] if i is not None]
    out: list[str] = []
    for i in ids:
        text = tokenizer.convert_ids_to_tokens(int(i))
        if text and text not in out:
            out.append(text)
    return out


def parameters(gen_config: dict) -> list[tuple[str, object]]:
    """Ollama PARAMETER lines from a generation_config. transformers decodes greedily unless
    do_sample is true, so a config without it gets temperature 0 (Ollama's default is 0.8)."""
    out: list[tuple[str, object]] = []
    if gen_config.get("do_sample"):
        for hf, ollama in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
            if gen_config.get(hf) is not None:
                out.append((ollama, gen_config[hf]))
    else:
        out.append(("temperature", 0))
    if gen_config.get("repetition_penalty") not in (None, 1.0):
        out.append(("repeat_penalty", gen_config["repetition_penalty"]))
    if gen_config.get("max_new_tokens"):
        out.append(("num_predict", gen_config["max_new_tokens"]))
    return out


def model_name(text: str) -> str:
    """An Ollama model name from a run name: lower case, letters, digits, '-', '_', '.'."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return name or "tunesmith-model"


def ollama_command(modelfile: Path, name: str) -> str:
    return f'ollama create {name} -f "{modelfile}"'


MODELFILE = "Modelfile"  # what `ollama create` reads when no -f is given


def _from_line(path: Path) -> str | None:
    """The FROM of a Modelfile ("./model.gguf"), or None when it has none or cannot be read."""
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.startswith("FROM "):
                    return line[5:].strip()
    except (OSError, UnicodeDecodeError):
        pass
    return None


def modelfile_name(folder: Path, gguf_name: str) -> str:
    """The name of the Modelfile for the GGUF `gguf_name` written into `folder`: `Modelfile`, unless
    the folder's `Modelfile` is another GGUF's (its FROM names another file, or it is not one of
    ours): then `<gguf name without .gguf>.Modelfile`. So a second GGUF exported into a folder gets
    its own Modelfile beside it, and neither export stops nor replaces the other's."""
    shared = folder / MODELFILE
    if not shared.exists() or _from_line(shared) == f"./{gguf_name}":
        return MODELFILE
    return f"{Path(gguf_name).stem}.{MODELFILE}"


def modelfile_of(folder: Path, gguf_name: str) -> Path | None:
    """The Modelfile in `folder` whose FROM is the GGUF `gguf_name` (modelfile_name's two names), or None."""
    for name in (f"{Path(gguf_name).stem}.{MODELFILE}", MODELFILE):
        if _from_line(folder / name) == f"./{gguf_name}":
            return folder / name
    return None


def write_modelfile(
    folder: Path,
    gguf_name: str,
    tokenizer,
    gen_config: dict,
    runtime_adds_bos: bool = False,
    name: str = MODELFILE,
    thinking=None,
) -> dict:
    """Write the Modelfile `folder/name` for the GGUF `gguf_name` beside it; returns what it holds
    (template translated or why not, stops, parameters) for the export report."""
    tr = translate(tokenizer, runtime_adds_bos, thinking)
    eos = gen_config.get("eos_token_id")
    gen_eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    stops = stop_tokens(tokenizer, gen_eos)
    params = parameters(gen_config)
    lines = [
        f"# Written by Tunesmith: `ollama create NAME -f {name}` in this folder.",
        f"FROM ./{gguf_name}",
    ]
    if tr.template is not None and '"""' not in tr.template:
        if tr.bos_dropped:
            lines.append(f"# {tr.bos_dropped!r} is left out of the template: llama.cpp adds the BOS token itself.")
        lines += [f"# {note}" for note in tr.notes]
        lines.append(f'TEMPLATE """{tr.template}"""')
    else:
        reason = tr.reason or "the template contains three double quotes"
        tr = Translation(None, reason)
        lines.append(f"# No TEMPLATE: the tokenizer's chat template cannot be translated ({reason}).")
        lines.append("# Ollama then uses the template in the GGUF's metadata if it recognises it.")
    for s in stops:
        lines.append(f"PARAMETER stop {json.dumps(s)}")
    for k, v in params:
        lines.append(f"PARAMETER {k} {v}")
    (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "template_translated": tr.template is not None,
        "template_reason": tr.reason,
        "template_bos_dropped": tr.bos_dropped,
        "stops": stops,
        "parameters": dict(params),
    }


def read_modelfile(path: Path) -> dict:
    """TEMPLATE, stops and parameters of a Modelfile written here (for the checks and the tests)."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)
    stops = [json.loads(s) for s in re.findall(r"^PARAMETER stop (.*)$", text, re.M)]
    params = dict(re.findall(r"^PARAMETER (?!stop )(\S+) (.*)$", text, re.M))
    frm = re.search(r"^FROM (.*)$", text, re.M)
    return {"template": m.group(1) if m else None, "stops": stops, "parameters": params, "from": frm.group(1)}
