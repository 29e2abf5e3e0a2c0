"""Detect a data set's shape and turn each row into chat messages (or plain text).

Shapes: instruction / input / output (Alpaca-style, also prompt/response, question/answer);
conversations as a list of messages in OpenAI form ({role, content}) or ShareGPT form
({from, value}), an answer's reasoning in its content (<think>...</think>) or in a field of its own
(REASONING_FIELDS); plain text. `data.columns` maps the canonical names onto the file's columns.
"""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.data.sources import SUFFIXES, DataError, csv_delimiter

# Canonical field -> column names we recognise, in order of preference.
ALIASES = {
    "messages": ["messages", "conversations", "conversation", "dialog", "chat"],
    "instruction": ["instruction", "prompt", "question", "query"],
    "input": ["input", "context"],
    "output": ["output", "response", "answer", "completion"],
    "system": ["system", "system_prompt"],
    "text": ["text", "content"],
    "tools": ["tools"],
}
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
# Fields a message may carry its reasoning in, apart from its content: OpenAI-style
# `reasoning_content`, Hugging Face's `reasoning` / `thinking` (the first one set is read).
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
KNOWN_KEYS = {"instruction", "input", "output", "system", "messages", "text", "tools"}
# A row's tool definitions (its "tools" column: JSON schemas, as OpenAI's fine-tuning format and
# transformers' apply_chat_template(tools=...) take them) ride on each of its messages under this key,
# so they survive the slicing and folding a render does; engine.data.render gives them to the
# template as its `tools`, never as a message field.
TOOLS_FIELD = "_tools"


@dataclass
class FormatSpec:
    kind: str  # "instruction" | "conversations" | "text"
    mapping: dict[str, str] = field(default_factory=dict)  # canonical name -> column

    def describe(self) -> str:
        cols = ", ".join(f"{k} <- {v}" for k, v in self.mapping.items())
        return f"{self.kind} ({cols})"


# The plain-words name of each shape's required fields, for the window and the CLI alike.
SHAPE_WORDS = {
    "conversations": "which column holds the conversation (a list of messages)",
    "instruction": "which column holds the prompt and which the answer",
    "text": "which column holds the text",
}
CONFIG_KEYS = {
    "conversations": "data.columns: {messages: COLUMN}",
    "instruction": "data.columns: {instruction: COLUMN, output: COLUMN}",
    "text": "data.columns: {text: COLUMN}",
}
NO_HEADER_HINT = "the first row looks like data: the file may have no header row"


class UnmatchedColumns(DataError):
    """The columns match no known shape. One message source with fields: `str()` is the CLI's
    sentence (file, columns, what to pick, the config key); the window formats `source`,
    `columns`, `kinds` and `hint` its own way, next to its mapping controls."""

    def __init__(self, columns: list[str], kinds: list[str], source: str | None = None, hint: str = ""):
        self.columns = list(columns)
        self.kinds = list(kinds)
        self.source = source
        self.hint = hint  # e.g. NO_HEADER_HINT, or ""
        super().__init__(self.cli_message())

    def what_to_pick(self) -> str:
        return "; or ".join(SHAPE_WORDS[k] for k in self.kinds)

    def cli_message(self) -> str:
        where = f"{self.source}: " if self.source else ""
        hint = f" ({self.hint})" if self.hint else ""
        keys = "; or ".join(CONFIG_KEYS[k] for k in self.kinds)
        return (
            f"{where}the columns {', '.join(self.columns) or '(none)'} match no known shape{hint}; "
            f"map them: pick {self.what_to_pick()} (in the window's Data page, or in the config: {keys})"
        )


def _looks_like_data(name: str) -> bool:
    text = name.strip()
    if not text:
        return False
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        pass
    return len(text) > 40 or len(text.split()) > 5 or text.endswith(("?", "."))


def header_looks_like_data(columns: list[str], rows: list[list[str]] | None = None) -> bool:
    """True when a CSV's "column names" read like a row of data: every name is numeric or a
    sentence, or the names repeat values found in the later rows."""
    names = [str(c) for c in columns if str(c).strip()]
    if not names:
        return False
    if all(_looks_like_data(n) for n in names):
        return True
    if rows:
        seen = {str(v).strip() for row in rows for v in row if str(v).strip()}
        if sum(n.strip() in seen for n in names) * 2 >= len(names):
            return True
    return False


def _csv_hint(source: str | None, columns: list[str]) -> str:
    """NO_HEADER_HINT when `source` is a CSV file whose first row looks like data, else ""."""
    if not source or SUFFIXES.get(Path(source).suffix.lower()) != "csv":
        return ""
    path = Path(source).expanduser()
    rows: list[list[str]] = []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(itertools.islice(csv.reader(f, delimiter=csv_delimiter(path)), 1, 51))
    except (OSError, UnicodeDecodeError, csv.Error):
        rows = []
    return NO_HEADER_HINT if header_looks_like_data(columns, rows) else ""


def detect_format(
    columns: list[str], wanted: str = "auto", mapping: dict[str, str] | None = None, source: str | None = None
) -> FormatSpec:
    """The shape of a data set with these columns. `source` (the file) only words the error:
    UnmatchedColumns names it, and a CSV whose first row looks like data gets NO_HEADER_HINT."""
    mapping = dict(mapping or {})
    for key, col in mapping.items():
        if key not in KNOWN_KEYS:
            raise DataError(f"data.columns.{key}: unknown field; use one of {', '.join(sorted(KNOWN_KEYS))}")
        if col not in columns:
            raise DataError(f"data.columns.{key}: column '{col}' is not in the data (columns: {', '.join(columns)})")
    lower = {c.lower(): c for c in columns}

    def find(key: str) -> str | None:
        if key in mapping:
            return mapping[key]
        for alias in ALIASES[key]:
            if alias in lower:
                return lower[alias]
        return None

    found = {k: find(k) for k in ALIASES}
    kinds = [wanted] if wanted != "auto" else ["conversations", "instruction", "text"]
    for kind in kinds:
        if kind == "conversations" and found["messages"]:
            spec = {"messages": found["messages"]}
            for opt in ("system", "tools"):  # a system prompt, or the tools, in a column of their own
                if found[opt]:
                    spec[opt] = found[opt]
            return FormatSpec(kind, spec)
        if kind == "instruction" and found["instruction"] and found["output"]:
            spec = {"instruction": found["instruction"], "output": found["output"]}
            for opt in ("input", "system"):
                if found[opt]:
                    spec[opt] = found[opt]
            return FormatSpec(kind, spec)
        if kind == "text" and found["text"]:
            return FormatSpec(kind, {"text": found["text"]})
    raise UnmatchedColumns(columns, kinds, source, _csv_hint(source, columns))


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} is {type(value).__name__}, not text")
    return value


def message_reasoning(msg: dict, i: int, message: dict) -> dict:
    """The reasoning a message carries in a field of its own ({"reasoning": text, "reasoning_field":
    the field's name}), or {}: engine.data.render hands it to the chat template under the name the
    template reads. An empty or null field is no reasoning (files write "reasoning_content": null)."""
    found = [(name, msg[name]) for name in REASONING_FIELDS if msg.get(name) not in (None, "")]
    if not found:
        return {}
    name, text = found[0]
    for other, value in found:
        if not isinstance(value, str):
            raise ValueError(f"message {i} field '{other}' is {type(value).__name__}, not text")
        if value != text:
            raise ValueError(f"message {i} has reasoning in both '{name}' and '{other}', and they differ: keep one")
    if message["role"] != "assistant":
        role = message["role"]
        raise ValueError(f"message {i} ({role}) has reasoning in '{name}': only an answer's reasoning is trained")
    if "<think>" in message["content"] or "</think>" in message["content"]:
        # Two reasonings for one answer: which one to train is not ours to guess.
        raise ValueError(f"message {i} has reasoning in '{name}' and a <think> block in its content: keep one")
    return {"reasoning": text, "reasoning_field": name}


def _has_reasoning(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and any(m.get(name) not in (None, "") for name in REASONING_FIELDS) for m in messages
    )


def carries_reasoning(raw, spec: FormatSpec, batch: int = 1000) -> bool:
    """Whether an answer of the data carries its reasoning in a field of its own (REASONING_FIELDS):
    what data.thinking "auto" turns the template's thinking on for. `raw`: a datasets.Dataset, or
    engine.data.scan.Rows over one (its first len(raw) rows). The Arrow column's type answers at
    once when no message has such a field; else the rows are read in slices up to the first."""
    if spec.kind != "conversations":
        return False
    ds, column, total = getattr(raw, "ds", raw), spec.mapping["messages"], len(raw)
    try:
        kind = ds.data.schema.field(column).type
        if not any(name in REASONING_FIELDS for name in getattr(kind.value_type, "names", REASONING_FIELDS)):
            return False
    except AttributeError:  # not Arrow-backed, or not a list of structs: read the rows
        pass
    for start in range(0, total, batch):
        if any(map(_has_reasoning, ds[start : min(total, start + batch)][column])):
            return True
    return False


def data_thinking(setting, raw, spec: FormatSpec) -> bool | None:
    """data.thinking (`setting`) as the chat template is given it (engine.data.render.thinking_vars):
    true/false as set; "auto" is on when an answer of `raw` carries its reasoning in a field of its
    own (carries_reasoning), else None: the template's own default."""
    if isinstance(setting, bool):
        return setting
    return True if carries_reasoning(raw, spec) else None


def row_to_messages(row: dict, spec: FormatSpec) -> list[dict] | str:
    """Chat messages for a row, or a plain string for text rows. Raises ValueError with a reason."""
    m = spec.mapping
    if spec.kind == "text":
        text = _text(row.get(m["text"]), f"column '{m['text']}'")
        if not text.strip():
            raise ValueError(f"column '{m['text']}' is empty")
        return text
    if spec.kind == "instruction":
        if isinstance(row.get(m["instruction"]), list):
            return _prompt_completion_messages(row, m)
        instruction = _text(row.get(m["instruction"]), f"column '{m['instruction']}'").strip()
        extra = _text(row.get(m["input"]), f"column '{m['input']}'").strip() if "input" in m else ""
        output = _text(row.get(m["output"]), f"column '{m['output']}'").strip()
        if not instruction:
            raise ValueError(f"column '{m['instruction']}' is empty")
        if not output:
            raise ValueError(f"column '{m['output']}' is empty")
        messages = []
        if "system" in m and row.get(m["system"]):
            messages.append({"role": "system", "content": _text(row[m["system"]], "system")})
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        return messages
    messages = _messages(row.get(m["messages"]), m["messages"])
    if not any(msg["role"] == "assistant" for msg in messages):
        raise ValueError("the conversation has no assistant message to train on")
    system = _text(row.get(m["system"]), f"column '{m['system']}'").strip() if "system" in m else ""
    if system and messages[0]["role"] != "system":  # the conversation's own system message wins
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(row.get(m["tools"]), m["tools"]) if "tools" in m else None
    if tools:
        for msg in messages:
            msg[TOOLS_FIELD] = tools
    return messages


def _tools(value, column: str) -> list | None:
    """A row's tool definitions: a list of JSON schemas, or its JSON text (OpenAI's format and most
    function-calling sets store them as a string)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column '{column}' is not JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"column '{column}' is not a list of tool definitions (JSON objects)")
    return value or None


def _tool_calls(msg: dict, i: int) -> list[dict]:
    """An assistant message's tool calls as chat templates read them (OpenAI's form: each
    {"type": "function", "function": {"name", "arguments"}}, its "id" kept), from OpenAI's tool_calls,
    the flat {"name", "arguments"} form, or the legacy function_call. Arguments given as JSON text are
    parsed: templates write them with `tojson`, which would quote the text once more."""
    calls = msg.get("tool_calls") or ([msg["function_call"]] if msg.get("function_call") else [])
    if not isinstance(calls, list):
        raise ValueError(f"message {i}'s tool_calls is not a list")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"message {i} has a tool call without a function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON: the template writes the text as it is
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _messages(raw, column: str, first: int = 0) -> list[dict]:
    """A column's list of messages (OpenAI's role/content or ShareGPT's from/value), normalized;
    `first`: the number of the first message in reasons (after a prompt's, for a completion)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"column '{column}' is not a non-empty list of messages")
    messages = []
    for i, msg in enumerate(raw, start=first):
        if not isinstance(msg, dict):
            raise ValueError(f"message {i} is not an object")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if role not in ROLE_NAMES:
            raise ValueError(f"message {i} has unknown role {role!r}")
        message = {"role": ROLE_NAMES[role], "content": _text(content, f"message {i} content")}
        message.update(message_reasoning(msg, i, message))
        if message["role"] == "assistant" and (msg.get("tool_calls") or msg.get("function_call")):
            message["tool_calls"] = _tool_calls(msg, i)
        elif message["role"] == "tool":  # which call a result answers, where the data says
            message.update({k: msg[k] for k in ("name", "tool_call_id") if isinstance(msg.get(k), str)})
        messages.append(message)
    return messages


def _prompt_completion_messages(row: dict, m: dict) -> list[dict]:
    """TRL's conversational prompt-completion rows: the prompt a list of messages, the completion a list
    (or one answer's text), one conversation. Every assistant answer in it is trained, as in any
    conversation: a prompt holding earlier answers trains those too (data.earlier_reasoning
    final_turn_only trains the last answer only, as TRL's completion-only loss does)."""
    prompt = _messages(row.get(m["instruction"]), m["instruction"])
    completion = row.get(m["output"])
    if isinstance(completion, list):
        answer = _messages(completion, m["output"], first=len(prompt))
    else:
        text = _text(completion, f"column '{m['output']}'").strip()
        if not text:
            raise ValueError(f"column '{m['output']}' is empty")
        answer = [{"role": "assistant", "content": text}]
    if answer[-1]["role"] != "assistant":
        raise ValueError(f"column '{m['output']}' does not end with an assistant message to train on")
    return prompt + answer
