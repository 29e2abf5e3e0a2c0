"""Detect a data set's shape and turn each row into chat messages (or plain text).

Shapes: instruction / input / output (Alpaca-style, also prompt/response, question/answer);
conversations as a list of messages in OpenAI form ({role, content}) or ShareGPT form
({from, value}); plain text. `data.columns` maps the canonical names onto the file's columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.data.sources import DataError

# Canonical field -> column names we recognise, in order of preference.
ALIASES = {
    "messages": ["messages", "conversations", "conversation", "dialog", "chat"],
    "instruction": ["instruction", "prompt", "question", "query"],
    "input": ["input", "context"],
    "output": ["output", "response", "answer", "completion"],
    "system": ["system", "system_prompt"],
    "text": ["text", "content"],
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
KNOWN_KEYS = {"instruction", "input", "output", "system", "messages", "text"}


@dataclass
class FormatSpec:
    kind: str  # "instruction" | "conversations" | "text"
    mapping: dict[str, str] = field(default_factory=dict)  # canonical name -> column

    def describe(self) -> str:
        cols = ", ".join(f"{k} <- {v}" for k, v in self.mapping.items())
        return f"{self.kind} ({cols})"


def detect_format(columns: list[str], wanted: str = "auto", mapping: dict[str, str] | None = None) -> FormatSpec:
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
            return FormatSpec(kind, {"messages": found["messages"]})
        if kind == "instruction" and found["instruction"] and found["output"]:
            spec = {"instruction": found["instruction"], "output": found["output"]}
            for opt in ("input", "system"):
                if found[opt]:
                    spec[opt] = found[opt]
            return FormatSpec(kind, spec)
        if kind == "text" and found["text"]:
            return FormatSpec(kind, {"text": found["text"]})
    need = {
        "conversations": "a messages column (data.columns: {messages: COLUMN})",
        "instruction": "instruction and output columns (data.columns: {instruction: COLUMN, output: COLUMN})",
        "text": "a text column (data.columns: {text: COLUMN})",
    }
    hint = "; or ".join(need[k] for k in kinds)
    raise DataError(f"the columns {', '.join(columns) or '(none)'} match no known shape; map them: {hint}")


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} is {type(value).__name__}, not text")
    return value


def row_to_messages(row: dict, spec: FormatSpec) -> list[dict] | str:
    """Chat messages for a row, or a plain string for text rows. Raises ValueError with a reason."""
    m = spec.mapping
    if spec.kind == "text":
        text = _text(row.get(m["text"]), f"column '{m['text']}'")
        if not text.strip():
            raise ValueError(f"column '{m['text']}' is empty")
        return text
    if spec.kind == "instruction":
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
    raw = row.get(m["messages"])
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"column '{m['messages']}' is not a non-empty list of messages")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ValueError(f"message {i} is not an object")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if role not in ROLE_NAMES:
            raise ValueError(f"message {i} has unknown role {role!r}")
        messages.append({"role": ROLE_NAMES[role], "content": _text(content, f"message {i} content")})
    if not any(msg["role"] == "assistant" for msg in messages):
        raise ValueError("the conversation has no assistant message to train on")
    return messages
