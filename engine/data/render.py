"""Render rows through the tokenizer's chat template and mark which tokens are trained.

The conversation is rendered to text once and tokenized once with character offsets; a token
is trained when it falls inside an assistant turn's content or its end-of-turn marker (so the
model learns to stop). Prompt tokens are masked unless responses-only training is off.
"""

from __future__ import annotations

from dataclasses import dataclass

# Used when a tokenizer ships no chat template (a base model): plain ChatML markers.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Tokenized:
    ids: list[int]
    trained: list[bool]


def ensure_chat_template(tokenizer) -> bool:
    """Give a template-less tokenizer the fallback; True when the fallback was set."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_TEMPLATE
    return True


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def trained_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of every assistant turn (content + end marker)."""
    text = _render(tokenizer, messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        end = len(_render(tokenizer, messages[: i + 1]))
        if not text.startswith(prefix):
            raise ValueError("the chat template does not render turns as prefixes; cannot mask prompts")
        spans.append((len(prefix), end))
    return text, spans


def tokenize_example(tokenizer, example, responses_only: bool = True) -> Tokenized:
    """Token ids and trained flags for one row (messages from formats.row_to_messages, or text)."""
    if isinstance(example, str):
        enc = tokenizer(example, add_special_tokens=False)
        ids = list(enc["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return Tokenized(ids, [True] * len(ids))
    text, spans = trained_spans(tokenizer, example)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not responses_only:
        return Tokenized(ids, [True] * len(ids))
    trained = []
    for s, e in enc["offset_mapping"]:
        # A token belongs to a span when its first character does.
        trained.append(any(a <= s < b for a, b in spans) and e > s)
    return Tokenized(ids, trained)
