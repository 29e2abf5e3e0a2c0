"""An Ollama `Modelfile` for a GGUF export: FROM the GGUF beside it, the chat template translated
from the tokenizer's Jinja template into Ollama's Go template, the stop tokens, and the
generation parameters of the run's generation_config. Ollama is not needed to write it.

The translation does not parse Jinja. It renders conversations through the tokenizer's own
template with marker contents and reads off what comes before and after each role's message
(ChatML, Llama-3, Gemma, Phi-3 and most chat templates render each message independently this
way), then renders the resulting Go template here (`render_go`, the small subset the
translation emits) on several conversations and keeps it only when every one matches the
tokenizer's rendering character for character. A template that puts a message's rendering
under conditions (a default system prompt, the system prompt merged into the first user turn,
content trimmed) cannot be translated this way: the Modelfile then has no TEMPLATE line, says
why in a comment, and Ollama falls back to the template in the GGUF's metadata."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROLES = ("system", "user", "assistant")
_MARK = "\x02{}\x03"  # marker contents no template changes


@dataclass
class Translation:
    template: Optional[str]  # the Go template, or None when the Jinja template cannot be translated
    reason: str = ""  # why not, one sentence
    bos_dropped: str = ""  # the BOS text left out because the runtime adds it
    system: bool = True  # system messages are rendered
    parts: dict = field(default_factory=dict)


def _render(tokenizer, messages, gen=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _split(text: str, n: int) -> Optional[list[str]]:
    """The text between markers 0..n-1 (n + 1 pieces), or None when a marker is missing."""
    pieces, rest = [], text
    for i in range(n):
        mark = _MARK.format(i)
        if mark not in rest:
            return None
        head, rest = rest.split(mark, 1)
        pieces.append(head)
    return pieces + [rest]


def _msgs(*roles: str) -> list[dict]:
    return [{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)]


def _decompose(tokenizer) -> tuple[Optional[dict], str]:
    try:
        one = _split(_render(tokenizer, _msgs("user")), 1)
        three = _split(_render(tokenizer, _msgs("user", "assistant", "user")), 3)
        with_gen = _render(tokenizer, _msgs("user"), gen=True)
        plain = _render(tokenizer, _msgs("user"))
    except Exception as exc:  # a template can raise on purpose; that is its answer
        return None, f"the template cannot render a plain user/assistant conversation ({exc})"
    if one is None or three is None:
        return None, "the template changes or drops message contents"
    x0, x1 = one
    y0, y1, y2, y3 = three
    if y0 != x0 or y3 != x1 or not y1.startswith(x1) or not with_gen.startswith(plain):
        return None, "the template does not render each message on its own (it depends on the turn)"
    bos = tokenizer.bos_token or ""
    if not (bos and x0.startswith(bos)):
        bos = ""
    user_pre, user_post = x0[len(bos) :], x1
    if not y2.endswith(user_pre):
        return None, "the template does not render each message on its own (it depends on the turn)"
    parts = {
        "bos": bos,
        "user": (user_pre, user_post),
        "assistant": (y1[len(user_post) :], y2[: len(y2) - len(user_pre)]),
        "gen": with_gen[len(plain) :],
    }
    try:  # system messages are optional: some templates refuse them
        z = _split(_render(tokenizer, _msgs("system", "user")), 2)
    except Exception:
        z = None
    if z is not None and z[0].startswith(bos) and z[1].endswith(user_pre) and z[2] == user_post:
        parts["system"] = (z[0][len(bos) :], z[1][: len(z[1]) - len(user_pre)])
    return parts, ""


def _lit(text: str) -> str:
    """Literal template text; a '{{' inside it is written as a Go string action."""
    return text.replace("{{", '{{ "{{" }}')


def _go_template(parts: dict, with_bos: bool) -> str:
    branches = []
    for role in ROLES:
        if role in parts:
            pre, post = parts[role]
            branches.append(f'if eq .Role "{role}" }}}}{_lit(pre)}{{{{ .Content }}}}{_lit(post)}')
    body = "{{ " + "{{ else ".join(branches) + "{{ end }}"
    head = _lit(parts["bos"]) if with_bos else ""
    return f"{head}{{{{ range .Messages }}}}{body}{{{{ end }}}}{_lit(parts['gen'])}"


# -- the Go template subset the translation writes, rendered here to check it -----------------
_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)


def render_go(template: str, messages: list[dict]) -> str:
    """Render the subset of Go's text/template that `translate` emits: literals, `range
    .Messages`, `if / else if eq .Role "x"`, `end`, `.Content`, `.Role` and string literals.
    Whitespace trimming (`{{-`) is not emitted and not supported. Raises ValueError otherwise."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(template):
        if m.group(0).startswith("{{-") or m.group(0).endswith("-}}"):
            raise ValueError("whitespace trimming is not part of the subset")
        tokens.append(("text", template[pos : m.start()]))
        tokens.append(("action", m.group(1)))
        pos = m.end()
    tokens.append(("text", template[pos:]))

    def block(i: int, msg: Optional[dict], out: list[str], emit: bool) -> tuple[int, str]:
        """Render tokens from i until an `end`/`else` at this level; returns (index, stopper)."""
        while i < len(tokens):
            kind, val = tokens[i]
            if kind == "text":
                if emit:
                    out.append(val)
                i += 1
            elif val == "range .Messages":
                start = i + 1
                end = start
                for m in messages if emit else [None]:
                    end, _ = block(start, m, out, emit and m is not None)
                if emit and not messages:
                    end, _ = block(start, None, [], False)
                i = end + 1
            elif val.startswith("if "):
                i = _if(i, val[3:], msg, out, emit)
            elif val == "end" or val.startswith("else"):
                return i, val
            elif val in (".Content", ".Role"):
                if emit:
                    out.append(str(msg[val[1:].lower()]))
                i += 1
            elif val.startswith('"') and val.endswith('"'):
                if emit:
                    out.append(json.loads(val))
                i += 1
            else:
                raise ValueError(f"unsupported action {{{{ {val} }}}}")
        return i, ""

    def cond(expr: str, msg: Optional[dict]) -> bool:
        m = re.fullmatch(r'eq \.Role "([^"]*)"', expr)
        if not m:
            raise ValueError(f"unsupported condition {expr!r}")
        return msg is not None and msg["role"] == m.group(1)

    def _if(i: int, expr: str, msg, out, emit) -> int:
        taken = False
        j = i + 1
        while True:
            ok = not taken and (expr is None or cond(expr, msg))
            j, stop = block(j, msg, out, emit and ok)
            taken = taken or ok
            if stop == "end":
                return j + 1
            if stop.startswith("else if "):
                expr = stop[len("else if ") :]
            elif stop == "else":
                expr = None
            else:
                raise ValueError("an if without its end")
            j += 1

    out: list[str] = []
    i, stop = block(0, None, out, True)
    if stop:
        raise ValueError(f"unexpected {{{{ {stop} }}}}")
    return "".join(out)


SAMPLES = [
    [{"role": "user", "content": "What is 2 plus 2?"}],
    [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "Answer: 4"},
        {"role": "user", "content": "And 3 plus 3?"},
    ],
]
SYSTEM_SAMPLES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Answer: hi"},
        {"role": "user", "content": "Again"},
    ],
]


def translate(tokenizer, runtime_adds_bos: bool = False) -> Translation:
    """The tokenizer's chat template as an Ollama Go template, checked on sample conversations."""
    if not getattr(tokenizer, "chat_template", None):
        return Translation(None, "the tokenizer has no chat template")
    parts, reason = _decompose(tokenizer)
    if parts is None:
        return Translation(None, reason)
    full = _go_template(parts, with_bos=True)
    samples = SAMPLES + (SYSTEM_SAMPLES if "system" in parts else [])
    for msgs in samples:
        want = _render(tokenizer, msgs, gen=True)
        got = render_go(full, msgs)
        if got != want:
            return Translation(
                None,
                "the template renders some conversations differently from a per-message translation "
                f"(first difference in {len(msgs)}-message conversation)",
            )
    drop = runtime_adds_bos and bool(parts["bos"])
    return Translation(
        _go_template(parts, with_bos=not drop),
        bos_dropped=parts["bos"] if drop else "",
        system="system" in parts,
        parts=parts,
    )


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


def write_modelfile(
    folder: Path,
    gguf_name: str,
    tokenizer,
    gen_config: dict,
    runtime_adds_bos: bool = False,
) -> dict:
    """Write `folder/Modelfile`; returns what it holds (template translated or why not, stops,
    parameters) for the export report."""
    tr = translate(tokenizer, runtime_adds_bos)
    eos = gen_config.get("eos_token_id")
    gen_eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    stops = stop_tokens(tokenizer, gen_eos)
    params = parameters(gen_config)
    lines = [
        "# Written by Tunesmith: `ollama create NAME -f Modelfile` in this folder.",
        f"FROM ./{gguf_name}",
    ]
    if tr.template is not None and '"""' not in tr.template:
        if tr.bos_dropped:
            lines.append(f"# {tr.bos_dropped!r} is left out of the template: llama.cpp adds the BOS token itself.")
        if not tr.system:
            lines.append("# The chat template has no system turn: system messages are not rendered.")
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
    (folder / "Modelfile").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "template_translated": tr.template is not None,
        "template_reason": tr.reason,
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
