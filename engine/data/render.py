"""Render rows through the tokenizer's chat template and mark which tokens are trained.

Right by construction: the conversation is rendered ONCE, and each assistant answer's content is
found inside that render, in order, searching forward from the end of the question before it. The
trained span of an answer is its content plus the end-of-turn token the template writes right after
it (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, <|end|> ...), so the model learns to stop; nothing
of the next turn, the system prompt or a question is ever trained. A template with
`{% generation %}` blocks says itself which characters are the assistant's (transformers'
assistant-token indices), and those are used instead. Tokens are trained when they overlap a span
(a sentencepiece word token "▁Hi" carries the blank before the answer).

Templates that change earlier turns: Qwen3's (and DeepSeek-R1's) drop the <think> reasoning of an
answer from the history, so that answer is rendered, and trained, without it. `earlier_reasoning`
says what to do (data.earlier_reasoning): "drop" trains those answers as rendered (the template's
own history), "final_turn_only" trains the last answer only, "keep" splits the conversation into
one example per answer, each answer the final turn of its own example, where its reasoning is
rendered. A Qwen3 answer without reasoning as the final turn renders after an empty
`<think>\\n\\n</think>\\n\\n` block: that block is NOT trained (it is what Qwen3's template writes
into the prompt when thinking is off), only the answer and <|im_end|>.

A template that raises on a row (system role unsupported, roles not alternating) gives a RowError
(a ValueError) naming the reason, so the row is dropped and reported, never the run stopped; with
`fold_system` the system message is folded into the first user turn first (Gemma-2's templates).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Used when a tokenizer ships no chat template (a base model): plain ChatML markers.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EARLIER_REASONING = ("drop", "final_turn_only", "keep")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Blanks a template may write between an answer and its end-of-turn token (Llama-2 style "... </s>").
_GAP = re.compile(r"[ \t]{0,2}")


class RowError(ValueError):
    """The chat template cannot render this row; the message says why (and what option helps)."""


@dataclass
class AnswerSpan:
    start: int  # characters of the rendered text: the answer's content ...
    end: int  # ... through its end-of-turn token when it has one
    ends_at_marker: bool  # an end-of-turn token follows the content
    reasoning_dropped: bool  # the template rendered the answer without its <think> reasoning


@dataclass
class Tokenized:
    ids: list[int]
    trained: list[bool]
    answers: list[AnswerSpan] = field(default_factory=list)
    folded_system: bool = False  # the system message went into the first user turn
    text: str = ""  # what was tokenized: the rendered conversation (or the plain text)


def ensure_chat_template(tokenizer) -> bool:
    """Give a template-less tokenizer the fallback; True when the fallback was set."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_TEMPLATE
    return True


def _template_errors() -> tuple[type[BaseException], ...]:
    from jinja2.exceptions import TemplateError

    # What a template's own raise_exception gives (TemplateError) and what its expressions raise
    # on data it did not expect (a missing key, a None where text was expected ...).
    return (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError)


SYSTEM_JOIN = "\n\n"  # between the system prompt and the first user message, in training and in the Modelfile


def fold_system_message(messages: list[dict]) -> list[dict]:
    """The system prompt put at the start of the first user turn (SYSTEM_JOIN between): what a
    template without a system turn (Gemma-2) is given, in training and in the exported Modelfile
    (engine.export.modelfile uses this same function, so the two never disagree)."""
    system = SYSTEM_JOIN.join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    rest = [dict(m) for m in messages if m["role"] != "system"]
    for m in rest:
        if system and m["role"] == "user":
            m["content"] = system + SYSTEM_JOIN + m["content"]
            break
    return rest


def render(tokenizer, messages: list[dict], fold_system: bool = False) -> tuple[str, list[dict], bool]:
    """(rendered text, the messages rendered, whether the system message was folded). RowError
    when the template rejects the row."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False), messages, False
    except _template_errors() as exc:
        reason = str(exc) or type(exc).__name__
        has_system = any(m["role"] == "system" for m in messages)
        if has_system and fold_system and messages[0]["role"] == "system":
            folded = fold_system_message(messages)
            try:
                return tokenizer.apply_chat_template(folded, tokenize=False), folded, True
            except _template_errors() as again:
                reason = f"{again or type(again).__name__} (after folding the system message into the first user turn)"
        elif has_system and "system" in reason.lower():
            reason += "; set data.fold_system_message: true to fold the system message into the first user turn"
        raise RowError(f"the chat template rejects this row: {reason}") from exc


def _special_strings(tokenizer) -> list[str]:
    specials = {str(s) for s in (getattr(tokenizer, "all_special_tokens", None) or [])}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    # Longest first, so "<|im_end|>" is matched rather than a shorter marker inside it.
    return sorted((s for s in specials if s.strip()), key=len, reverse=True)


def _end_marker(text: str, at: int, specials: list[str]) -> int:
    """The end of the end-of-turn token right after position `at` (past a blank or two), or -1."""
    gap = _GAP.match(text, at).end()
    for s in specials:
        if text.startswith(s, gap):
            return gap + len(s)
    return -1


def _candidates(content: str) -> list[tuple[str, bool]]:
    """What an answer may look like in the render: itself, trimmed, or (a template that drops
    reasoning from it) what follows its </think>."""
    out = [(content, False), (content.strip(), False)]
    if "</think>" in content:
        out.append((content.split("</think>")[-1].strip(), True))
    return [(c, dropped) for c, dropped in out if c]


def answer_spans(tokenizer, messages: list[dict], text: str) -> list[AnswerSpan]:
    """Every assistant answer's span in `text` (the render of `messages`), in order."""
    specials = _special_strings(tokenizer)
    spans, pos, number = [], 0, 0
    for msg in messages:
        content = msg.get("content") or ""
        if msg["role"] in ("user", "tool"):
            # Past the question, so an answer that repeats it ("OK" after "Say OK") is found after it.
            at = text.find(content.strip(), pos) if content.strip() else -1
            pos = at + len(content.strip()) if at >= 0 else pos
            continue
        if msg["role"] != "assistant":
            continue  # a system prompt may sit anywhere (folded into a later turn): never a bound
        number += 1
        for cand, dropped in _candidates(content):
            at = text.find(cand, pos)
            if at >= 0:
                break
        else:
            if not content.strip():
                continue  # an empty answer: nothing to find (its row trains the others)
            raise RowError(f"answer {number} is not in the rendered conversation (the chat template rewrites it)")
        end = at + len(cand)
        marker_end = _end_marker(text, end, specials)
        spans.append(AnswerSpan(at, marker_end if marker_end >= 0 else end, marker_end >= 0, dropped))
        pos = spans[-1].end
    return spans


def _generation_spans(tokenizer, messages: list[dict]) -> tuple[str, list[AnswerSpan]] | None:
    """The render and the `{% generation %}` spans, for a template that marks them."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not _GENERATION_TAG.search(template):
        return None
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[messages],
        chat_template=template,
        return_assistant_tokens_mask=True,
        **getattr(tokenizer, "special_tokens_map", {}),
    )
    text = rendered[0]
    specials = _special_strings(tokenizer)
    spans = []
    for start, end in indices[0]:
        ends = any(text[start:end].rstrip().endswith(s) for s in specials)
        spans.append(AnswerSpan(start, end, ends, False))
    return text, spans


def trained_spans(tokenizer, messages: list[dict], fold_system: bool = False) -> tuple[str, list[AnswerSpan]]:
    """The rendered text and each assistant answer's span (content + end-of-turn token)."""
    text, rendered, _ = render(tokenizer, messages, fold_system)
    marked = _generation_spans(tokenizer, rendered)
    if marked is not None:
        return marked
    return text, answer_spans(tokenizer, rendered, text)


def _mask(tokenizer, text: str, spans: list[AnswerSpan], responses_only: bool):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not responses_only:
        return ids, [True] * len(ids)
    # A token is trained when it overlaps an answer's span.
    trained = [e > s and any(s < sp.end and e > sp.start for sp in spans) for s, e in enc["offset_mapping"]]
    return ids, trained


def tokenize_example(
    tokenizer,
    example,
    responses_only: bool = True,
    fold_system: bool = False,
    earlier_reasoning: str = "drop",
) -> Tokenized:
    """Token ids and trained flags for one row (messages from formats.row_to_messages, or text).
    For earlier_reasoning "keep" this is the whole conversation as rendered (what the window shows);
    tokenize_row gives the examples training uses."""
    if isinstance(example, str):
        enc = tokenizer(example, add_special_tokens=False)
        ids = list(enc["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return Tokenized(ids, [True] * len(ids), text=example)
    text, rendered, folded = render(tokenizer, example, fold_system)
    marked = _generation_spans(tokenizer, rendered)
    spans = marked[1] if marked is not None else answer_spans(tokenizer, rendered, text)
    trained_spans_ = spans[-1:] if earlier_reasoning == "final_turn_only" else spans
    ids, trained = _mask(tokenizer, text, trained_spans_, responses_only)
    return Tokenized(ids, trained, spans, folded, text)


def tokenize_row(
    tokenizer,
    example,
    responses_only: bool = True,
    fold_system: bool = False,
    earlier_reasoning: str = "drop",
) -> list[Tokenized]:
    """The examples one row trains: one, or (earlier_reasoning "keep", and the template dropped the
    reasoning of an earlier answer) one per answer, each ending at its answer, which alone is
    trained, with its reasoning rendered."""
    whole = tokenize_example(tokenizer, example, responses_only, fold_system, earlier_reasoning)
    if isinstance(example, str) or earlier_reasoning != "keep" or not any(a.reasoning_dropped for a in whole.answers):
        return [whole]
    out = []
    for i, msg in enumerate(example):
        if msg["role"] == "assistant":
            out.append(tokenize_example(tokenizer, example[: i + 1], responses_only, fold_system, "final_turn_only"))
    return out
