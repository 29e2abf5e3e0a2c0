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

The thinking switch (data.thinking): some templates render an answer's reasoning only when a
template variable says so (DeepSeek-V3.2/V4's `thinking`, Kimi-K3's `thinking`) or change the
generation prompt with it (Qwen3's `enable_thinking`: false writes an empty <think></think> block
into it). `thinking` (True/False; None: the template's default) is passed under each of those names
the template reads (template_switches), in every render here, so training, the X-ray, the preview
and the chat render one conversation alike. An answer whose reasoning block the generation prompt
opens (DeepSeek-V3.2 with thinking on ends its prompt with "<think>") is trained from the end of
that prompt: the model never writes the opening tag.

A template that raises on a row (system role unsupported, roles not alternating) gives a RowError
(a ValueError) naming the reason, so the row is dropped and reported, never the run stopped; with
`fold_system` the system message is folded into the first user turn first (Gemma-2's templates).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

from engine.data.formats import TOOLS_FIELD

# Used when a tokenizer ships no chat template (a base model): plain ChatML markers.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EARLIER_REASONING = ("drop", "final_turn_only", "keep")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Blanks a template may write between an answer and its end-of-turn token: Llama-2's "... </s>",
# Nemotron-Nano-v2's "...\n<SPECIAL_12>", Apriel's "...\n<|end|>", Reka's "...\n\n<sep>". They are
# trained with the token: the model writes them before it stops.
_GAP = re.compile(r"[ \t\r\n]{0,2}")
# A user turn put after a conversation whose last answer the template leaves open (_close_last_answers).
_PROBE = {"role": "user", "content": "?"}
_TOOL_PROBE = {"role": "tool", "content": "?"}
# The tag right before a reasoning text a template renders in its own way (GLM's "<think>...</think>").
_THINK_OPEN = re.compile(r"<(?!/)[^<>\s]*think[^<>\s]*>\s*$")
_THINK_OPEN_AT = re.compile(r"<(?!/)[^<>\s]*think[^<>\s]*>")
_THINK_CLOSE = re.compile(r"\s*</[^<>\s]*think[^<>\s]*>\s*")


class RowError(ValueError):
    """The chat template cannot render this row; the message says why (and what option helps)."""


@dataclass
class AnswerSpan:
    start: int  # characters of the rendered text: the answer's content ...
    end: int  # ... through its end-of-turn token when it has one
    ends_at_marker: bool  # an end-of-turn token follows the content
    reasoning_dropped: bool  # the template rendered the answer without its <think> reasoning
    content_end: int = -1  # where the content ends (the end-of-turn token follows), when found by search
    end_added: bool = False  # the template wrote no end-of-turn token after this last answer: one was added


@dataclass
class Tokenized:
    ids: list[int]
    trained: list[bool]
    answers: list[AnswerSpan] = field(default_factory=list)
    folded_system: bool = False  # the system message went into the first user turn
    text: str = ""  # what was tokenized: the rendered conversation (or the plain text)


def _has_tools(conversation: list[dict]) -> bool:
    return any(TOOLS_FIELD in m for m in conversation)


def apply_template(tokenizer, conversation: list[dict], **kwargs) -> str:
    """tokenizer.apply_chat_template of one conversation as text, the row's tool definitions (formats'
    TOOLS_FIELD on its messages) given as the template's `tools` and taken off the messages."""
    if _has_tools(conversation):
        kwargs["tools"] = next(m[TOOLS_FIELD] for m in conversation if TOOLS_FIELD in m)
        conversation = [{k: v for k, v in m.items() if k != TOOLS_FIELD} for m in conversation]
    return tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)


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


# The names templates read a message's reasoning from (Qwen3, DeepSeek-V3.2/V4, Kimi-K2-Thinking:
# reasoning_content; gpt-oss, LFM2.5: thinking; Solar, Hy3, Laguna: reasoning). A template ignores
# the names it does not read, so the reasoning is passed under all three.
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
_READS_REASONING = re.compile(r"(?:\.|['\"])(?:reasoning_content|reasoning|thinking)\b")
THINK_BLOCK = "<think>\n{}\n</think>\n\n"  # an answer's reasoning written into its content


def _reasoning_place(tokenizer) -> str:
    """Where this tokenizer's template takes an answer's reasoning: "field" (it reads one of
    REASONING_NAMES), "inline" (it reads none, but knows <think> blocks: in its source, as DeepSeek-V3.1's
    does, or as a token of the vocabulary), or "none"."""
    template = getattr(tokenizer, "chat_template", None)
    place = _template_place(template if isinstance(template, str) else "")
    if place:
        return place
    think = tokenizer.convert_tokens_to_ids("<think>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    return "inline" if think is not None and think != getattr(tokenizer, "unk_token_id", None) else "none"


@functools.lru_cache(maxsize=16)
def _template_place(template: str) -> str | None:
    """_reasoning_place from the template's source alone, once per template (not once per row)."""
    if _READS_REASONING.search(template):
        return "field"
    return "inline" if "<think>" in template else None


# The template variables that switch a template's thinking on or off, by their names in the template.
THINKING_SWITCHES = ("thinking", "enable_thinking")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


@functools.lru_cache(maxsize=16)
def template_switches(template: str) -> tuple[str, ...]:
    """The names of THINKING_SWITCHES this template reads from its context: what jinja2 finds
    undeclared in its source (a message's `thinking` field, `message.thinking`, is not one), so a
    name is passed only to a template that reads it. () for a template jinja2 cannot parse."""
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=[loopcontrols])
    try:  # transformers' {% generation %} tag is its own extension: left out, it changes no name
        names = meta.find_undeclared_variables(env.parse(_GENERATION_BLOCK.sub("", template)))
    except TemplateSyntaxError:
        return ()
    return tuple(name for name in THINKING_SWITCHES if name in names)


def thinking_vars(tokenizer, thinking) -> dict:
    """The keyword arguments that pass `thinking` to this tokenizer's chat template: {name: thinking}
    for each switch it reads (template_switches); {} for None or "auto" (the template's default: a
    run's config.yaml keeps "auto" when its data carried no reasoning field, so the chat reads it so)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(thinking, bool) or not isinstance(template, str):
        return {}
    return dict.fromkeys(template_switches(template), thinking)


def with_reasoning(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as the template is given them: an answer's reasoning field (formats'
    "reasoning") under every name of REASONING_NAMES, or written into its content as a <think>
    block for a template that reads no field, so the template renders it as it renders the same
    answer with the reasoning written inline. RowError, naming the message and its field, for a
    template with no place for reasoning at all (dropping it silently would train a different answer)."""
    if not any(m.get("reasoning") for m in messages):
        return messages
    place = _reasoning_place(tokenizer)
    out = []
    for k, m in enumerate(messages):
        text = m.get("reasoning")
        if text and place == "field":
            m = {**m, **dict.fromkeys(REASONING_NAMES, text)}
        elif text and place == "inline":
            m = {key: value for key, value in m.items() if key not in ("reasoning", "reasoning_field")}
            m["content"] = THINK_BLOCK.format(text) + m["content"]
        elif text:
            field_ = m.get("reasoning_field", "reasoning")
            raise RowError(
                f"message {k} has reasoning in '{field_}', and this chat template has no place for it "
                "(it reads no reasoning field and knows no <think> block); remove the field, or train a "
                "reasoning model's template"
            )
        out.append(m)
    return out


def render(
    tokenizer,
    messages: list[dict],
    fold_system: bool = False,
    generation_prompt: bool = False,
    thinking: bool | None = None,
) -> tuple[str, list[dict], bool]:
    """(rendered text, the messages rendered, whether the system message was folded). RowError
    when the template rejects the row. `generation_prompt`: end with the assistant's opening (a
    prompt that generation or a preference answer continues). `thinking`: the switch (thinking_vars)."""
    switch = thinking_vars(tokenizer, thinking)

    def apply(msgs):
        return apply_template(tokenizer, msgs, add_generation_prompt=generation_prompt, **switch)

    messages = with_reasoning(tokenizer, messages)
    try:
        return apply(messages), messages, False
    except _template_errors() as exc:
        reason = (str(exc) or type(exc).__name__) + _tool_use_hint(tokenizer, exc)
        has_system = bool(messages) and messages[0]["role"] == "system"
        if has_system and fold_system:
            folded = fold_system_message(messages)
            try:
                return apply(folded), folded, True
            except _template_errors() as again:
                reason = f"{again or type(again).__name__} (after folding the system message into the first user turn)"
        elif has_system and _renders(apply, fold_system_message(messages)):
            # The template has no system turn (Gemma-2's says so; Mistral v0.2's says the roles do
            # not alternate): folding it into the first user turn renders, so offer that.
            reason += "; set data.fold_system_message: true to fold the system message into the first user turn"
        raise RowError(f"the chat template rejects this row: {reason}") from exc


_TOOLS_LOOP = re.compile(r"\bfor\s+\w+\s+in\s+(tools)\b")
_TOOLS_UNDEFINED = re.compile(r"'(tools|functions)' is undefined")


def _tool_use_hint(tokenizer, exc: BaseException) -> str:
    """What to do when a tool-use template fails for want of tools: Hermes-2-Pro/3's and
    Command-R+'s "tool_use" templates loop over `tools` (None for a tool-less row: "'NoneType'
    object is not iterable"), FireFunction-v2's adds `functions` to its system prompt ("'functions'
    is undefined"). Training passes no tools."""
    template = getattr(tokenizer, "chat_template", None)
    said = str(exc)
    used = _TOOLS_UNDEFINED.search(said)
    if used is None and isinstance(template, str) and "'NoneType' object is not iterable" in said:
        used = _TOOLS_LOOP.search(template)
    if used is None:
        return ""
    return (
        f" (a tool-use chat template: it reads `{used.group(1)}`, which training does not pass; use the "
        "model's default chat template, e.g. the one named 'default' in tokenizer_config.json)"
    )


def _renders(apply, messages: list[dict]) -> bool:
    try:
        apply(messages)
        return True
    except _template_errors():
        return False


class _Specials(list):
    """The tokenizer's special strings, longest first, and for each pair of adjacent characters the
    specials that hold it: a text position inside a special token has such a pair around it, so
    _cuts_special looks only at those specials (none, for the usual "\nA" or ".<" at an answer's ends)."""

    def __init__(self, strings):
        super().__init__(strings)
        self.firsts = {s[0] for s in self}  # what a special token can start with
        self.by_pair: dict[str, list[str]] = {}
        for s in self:
            for pair in {s[k : k + 2] for k in range(len(s) - 1)}:
                self.by_pair.setdefault(pair, []).append(s)


def _special_strings(tokenizer) -> list[str]:
    specials = {str(s) for s in (getattr(tokenizer, "all_special_tokens", None) or [])}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    # Longest first, so "<|im_end|>" is matched rather than a shorter marker inside it.
    return _Specials(sorted((s for s in specials if s.strip()), key=len, reverse=True))


def _cuts_special(text: str, at: int, specials: list[str]) -> bool:
    """Whether position `at` falls inside a special token written in `text` (between two of its
    characters): a match starting or ending there is part of the token's name, not of a message
    (the answer "OK" inside Cohere's <|END_OF_TURN_TOKEN|>)."""
    if at <= 0 or at >= len(text):
        return False
    by_pair = getattr(specials, "by_pair", None)
    for s in specials if by_pair is None else by_pair.get(text[at - 1 : at + 1], ()):
        k = text.find(s, max(0, at - len(s) + 1), at + len(s) - 1)
        if 0 <= k < at:
            return True
    return False


def _find(text: str, needle: str, pos: int, specials: list[str]) -> int:
    """text.find(needle, pos), skipping a match that starts or ends inside a special token."""
    at = text.find(needle, pos)
    while at >= 0 and (_cuts_special(text, at, specials) or _cuts_special(text, at + len(needle), specials)):
        at = text.find(needle, at + 1)
    return at


def _special_at(text: str, at: int, specials: list[str]) -> int:
    firsts = getattr(specials, "firsts", None)
    if firsts is not None and (at >= len(text) or text[at] not in firsts):
        return -1
    for s in specials:
        if text.startswith(s, at):
            return at + len(s)
    return -1


def _end_marker(text: str, at: int, specials: list[str], eos: str | None = None) -> int:
    """The end of the end-of-turn token right after position `at` (past a blank or two), or -1.
    A turn that closes with several special tokens in a row, the last of them the EOS (Command-R7B's
    <|END_RESPONSE|><|END_OF_TURN_TOKEN|>, Command-A's <|END_TEXT|><|END_OF_TURN_TOKEN|>), ends after
    the EOS: the model has to write them all to stop. A row of specials without the EOS ends after
    the first (<|eot_id|><|start_header_id|>: the second opens the next turn)."""
    gap = _GAP.match(text, at).end()
    end = _special_at(text, gap, specials)
    if end < 0 or not eos or text[gap:end] == eos:
        return end
    first, at = end, end
    while (nxt := _special_at(text, at, specials)) >= 0:
        if text[at:nxt] == eos:
            return nxt
        at = nxt
    return first


def _locate(text: str, content: str, pos: int, specials: list[str]) -> tuple[int, int, bool] | None:
    """Where an answer is in the render, searching from `pos`: (start, end of its content, whether
    the template dropped its reasoning), or None. It may be there as written, trimmed, with its
    reasoning rendered in the template's own way (GLM, StepFun, Ling: "<think>r</think>answer"
    trimmed or re-spaced; trained from the opening tag), or (a template that drops reasoning from
    it) only what follows its </think>."""
    for cand in (content, content.strip()):
        at = _find(text, cand, pos, specials) if cand else -1
        if at >= 0:
            return at, at + len(cand), False
    if "</think>" not in content:
        return None
    before, _, final = content.rpartition("</think>")
    reasoning, final = before.split("<think>", 1)[-1].strip(), final.strip()
    if reasoning and final:
        r = _find(text, reasoning, pos, specials)
        close = _THINK_CLOSE.match(text, r + len(reasoning)) if r >= 0 else None
        if close and text.startswith(final, close.end()):
            opener = _THINK_OPEN.search(text, pos, r)
            return (opener.start() if opener else r), close.end() + len(final), False
    at = _find(text, final, pos, specials) if final else -1
    return (at, at + len(final), True) if at >= 0 else None


def _own_reasoning(tokenizer, before: list[dict], text: str, reasoning: str, pos: int, found, specials, thinking=None):
    """`found` (an answer found without its reasoning), or the span from its reasoning, for a template
    that renders a reasoning field between its own markers (gpt-oss's <|channel|>analysis<|message|>,
    Cohere's <|START_THINKING|>, Solar's <|think|>): what the model writes after the generation prompt
    of the conversation `before` the answer is trained, those markers with it, as a <think> block is."""
    at = _find(text, reasoning.strip(), pos, specials)
    if at < 0 or at >= found[0]:
        return found  # the template left the reasoning out: it is dropped
    start = at
    try:
        prompt = render(tokenizer, before, generation_prompt=True, thinking=thinking)[0]
    except RowError:
        prompt = ""
    common = len(os.path.commonprefix([prompt, text[: len(prompt)]]))
    if pos <= common <= at and common == len(prompt):  # the render continues the generation prompt
        start = common
    return start, found[1], False


_OPENS_REASONING: dict[tuple, bool] = {}


def _prompt_opens_reasoning(tokenizer, thinking) -> bool:
    """Whether this template's generation prompt, with this switch, ends with a reasoning block's
    opening tag (DeepSeek-V3.2's "<think>" with thinking on; not Qwen3's): only then is an answer's
    span moved past the prompt (_past_prompt, one more render per answer). Once per template and switch."""
    template = getattr(tokenizer, "chat_template", None)
    key = (template, thinking if isinstance(thinking, bool) else None)
    if key not in _OPENS_REASONING:
        try:
            prompt = render(tokenizer, [_PROBE], generation_prompt=True, thinking=thinking)[0]
        except RowError:
            prompt = ""
        if len(_OPENS_REASONING) > 16:
            _OPENS_REASONING.clear()
        _OPENS_REASONING[key] = bool(_THINK_OPEN.search(prompt))
    return _OPENS_REASONING[key]


def _past_prompt(tokenizer, before: list[dict], text: str, found, thinking) -> tuple:
    """`found` (an answer found from its reasoning's opening tag) starting where the generation prompt
    of the conversation `before` it ends, when that prompt already holds the tag (DeepSeek-V3.2's with
    thinking on ends "<｜Assistant｜><think>"): the model never writes what its prompt holds."""
    try:
        prompt = render(tokenizer, before, generation_prompt=True, thinking=thinking)[0]
    except RowError:
        return found
    if found[0] < len(prompt) < found[1] and text.startswith(prompt):
        return len(prompt), found[1], found[2]
    return found


def answer_spans(
    tokenizer, messages: list[dict], text: str, specials: list[str] | None = None, thinking: bool | None = None
) -> list[AnswerSpan]:
    """Every assistant answer's span in `text` (the render of `messages`), in order. `specials`:
    the tokenizer's special strings, longest first (_special_strings), when the caller has them.
    `thinking`: the switch `text` was rendered with."""
    specials = _special_strings(tokenizer) if specials is None else specials
    eos = getattr(tokenizer, "eos_token", None)
    spans, pos, number = [], 0, 0
    for k, msg in enumerate(messages):
        content = msg.get("content") or ""
        if msg["role"] in ("user", "tool"):
            # Past the question, so an answer that repeats it ("OK" after "Say OK") is found after it.
            at = _find(text, content.strip(), pos, specials) if content.strip() else -1
            pos = at + len(content.strip()) if at >= 0 else pos
            continue
        if msg["role"] != "assistant":
            continue  # a system prompt may sit anywhere (folded into a later turn): never a bound
        number += 1
        if msg.get("tool_calls"):
            from engine.data.tool_spans import tool_call_span  # it builds on this module's helpers

            span = tool_call_span(tokenizer, messages, k, text, pos, specials, thinking)
            if span is None:
                raise RowError(
                    f"answer {number} calls a tool, and where the chat template writes the call could not be "
                    "found (the template does not render the conversation up to it as a prefix)"
                )
            spans.append(span)
            pos = span.end
            continue
        if msg.get("reasoning"):  # given to the template in a field: trained with the answer, as if inline
            content = THINK_BLOCK.format(msg["reasoning"]) + content
        found = _locate(text, content, pos, specials)
        if found is not None and found[2] and msg.get("reasoning"):
            found = _own_reasoning(tokenizer, messages[:k], text, msg["reasoning"], pos, found, specials, thinking)
        if found is not None and thinking is True and msg.get("reasoning") and _THINK_OPEN_AT.match(text, found[0]):
            if _prompt_opens_reasoning(tokenizer, thinking):
                found = _past_prompt(tokenizer, messages[:k], text, found, thinking)
        if found is None:
            if not content.strip():
                continue  # an empty answer: nothing to find (its row trains the others)
            raise RowError(f"answer {number} is not in the rendered conversation (the chat template rewrites it)")
        at, end, dropped = found
        marker_end = _end_marker(text, end, specials, eos)
        spans.append(AnswerSpan(at, marker_end if marker_end >= 0 else end, marker_end >= 0, dropped, end))
        pos = spans[-1].end
    return spans


def _marks_generation(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def _generation_spans(
    tokenizer, messages: list[dict], specials: list[str], thinking: bool | None = None
) -> tuple[str, list[AnswerSpan]]:
    """The render and the `{% generation %}` spans, for a template that marks them (_marks_generation)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = next((m[TOOLS_FIELD] for m in messages if TOOLS_FIELD in m), None)
    if tools is not None:
        messages = [{k: v for k, v in m.items() if k != TOOLS_FIELD} for m in messages]
    rendered, indices = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=tokenizer.chat_template,
        return_assistant_tokens_mask=True,
        **getattr(tokenizer, "special_tokens_map", {}),
        **thinking_vars(tokenizer, thinking),
    )
    text = rendered[0]
    opening = _generation_opening(tokenizer, messages, thinking)
    spans = []
    for start, end in indices[0]:
        # Poolside's Laguna blocks open with the assistant's header, which the generation prompt
        # already holds: the model never writes it, so it is not trained.
        skip = _opening_at(text, start, opening)
        if skip and start + skip < end:
            start += skip
        # LFM2.5's and Laguna's blocks run past the end-of-turn token to the newline before the next
        # turn: that separator is the template's, not the answer's.
        kept = text[start:end].rstrip()
        ends = any(kept.endswith(s) for s in specials)
        spans.append(AnswerSpan(start, start + len(kept) if ends else end, ends, False))
    return text, spans


def _opening_at(text: str, at: int, opening: str) -> int:
    """How much of the generation prompt's opening starts the block at `at`: all of it, or the part
    the two share up to a token's end (a blank, or a marker's closing '>' or ']'): Laguna-XS's prompt
    is "<assistant>\n</think>", its block with the answer's own reasoning "<assistant>\n<think>..."."""
    n = 0
    while n < len(opening) and at + n < len(text) and text[at + n] == opening[n]:
        n += 1
    while 0 < n < len(opening) and not (opening[n - 1].isspace() or opening[n - 1] in ">]"):
        n -= 1
    return n


def _generation_opening(tokenizer, messages: list[dict], thinking: bool | None = None) -> str:
    """What the generation prompt adds before the first answer (its header: "<assistant>\n</think>"),
    or "" when the template does not render the prompt as a prefix of the conversation."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), 0)
    if first == 0:
        return ""
    try:
        switch = thinking_vars(tokenizer, thinking)
        before = apply_template(tokenizer, messages[:first], **switch)
        prompt = apply_template(tokenizer, messages[:first], add_generation_prompt=True, **switch)
    except _template_errors():
        return ""
    return prompt[len(before) :] if prompt.startswith(before) else ""


def trained_spans(
    tokenizer, messages: list[dict], fold_system: bool = False, thinking: bool | None = None
) -> tuple[str, list[AnswerSpan]]:
    """The rendered text and each assistant answer's span (content + end-of-turn token)."""
    text, rendered, _ = render(tokenizer, messages, fold_system, thinking=thinking)
    specials = _special_strings(tokenizer)
    if _marks_generation(tokenizer):
        return _generation_spans(tokenizer, rendered, specials, thinking)
    return text, answer_spans(tokenizer, rendered, text, specials, thinking)


def _render_all(tokenizer, conversations: list[list[dict]], fold_system: bool, thinking: bool | None = None) -> list:
    """render() of each conversation: (text, messages rendered, folded), or the RowError it raises.
    One apply_chat_template call renders them all (transformers renders a list of conversations one
    by one with the same code, without its per-call set-up); when a row raises, they are rendered
    one at a time, so each row gets its own answer or error."""
    # An empty one is refused alone (a batch would render it as nothing); one call takes one set of tools.
    if all(conversations) and not any(_has_tools(conv) for conv in conversations):
        try:
            conversations = [with_reasoning(tokenizer, conv) for conv in conversations]
            switch = thinking_vars(tokenizer, thinking)
            texts = tokenizer.apply_chat_template(conversations, tokenize=False, **switch) if conversations else []
            return [(text, conv, False) for text, conv in zip(texts, conversations)]
        except _template_errors():  # RowError too (a ValueError): each row below gets its own
            pass
    out = []
    for conv in conversations:
        try:
            out.append(render(tokenizer, conv, fold_system, thinking=thinking))
        except RowError as exc:
            out.append(exc)
    return out


def _close_last_answers(tokenizer, rendered: list[list], specials: list[str], thinking: bool | None = None) -> None:
    """Give a last answer the end-of-turn token its template leaves off (in place on `rendered`'s
    [row, text, spans, folded, messages]). GLM-4.5/4.6/4.7 end an answer with the next turn's
    <|user|> (a stop token of theirs), Apertus writes <|assistant_end|> when the next user turn
    opens, Hunyuan and Apriel write their end token only when another turn follows: the render of a
    conversation ends right after its last answer, and trained as it is the model never learns to
    stop. What the template writes after that answer when a user turn follows (the conversation
    rendered again with one more user turn) is put after it and trained, as GLM's own fine-tuning
    script appends <|user|>. A template that writes no special token there either is left as it
    is (the X-ray says missing_eos)."""
    open_ = [
        r
        for r in rendered
        if r[2]
        and r[4][-1]["role"] == "assistant"
        and not r[2][-1].ends_at_marker
        and r[2][-1].content_end >= 0
        and not r[1][r[2][-1].end :].strip()
    ]
    if not open_:
        return
    eos = getattr(tokenizer, "eos_token", None)
    # After a tool call the next turn is the tool's result (GLM opens it with <|observation|>, not <|user|>).
    probes = _render_all(
        tokenizer, [r[4] + [_TOOL_PROBE if r[4][-1].get("tool_calls") else _PROBE] for r in open_], False, thinking
    )
    for r, got in zip(open_, probes):
        if isinstance(got, RowError):
            continue
        ptext, pmessages, _ = got
        try:
            pspans = answer_spans(tokenizer, pmessages, ptext, specials, thinking)
        except RowError:
            continue
        if len(pspans) != len(r[2]) or not pspans[-1].ends_at_marker:
            continue
        closing = ptext[pspans[-1].content_end : pspans[-1].end]
        if _end_marker(closing, 0, specials, eos) != len(closing):
            continue  # not a blank or two and special tokens only
        last, text = r[2][-1], r[1]
        r[1] = text[: last.end] + closing + text[last.end :]
        r[2][-1] = AnswerSpan(last.start, last.end + len(closing), True, last.reasoning_dropped, last.end, True)


def render_closed(tokenizer, messages: list[dict], fold_system: bool = False, thinking: bool | None = None) -> str:
    """render() of a conversation that ends with an answer, with the end-of-turn token the template
    leaves off that answer put after it, as training puts it (_close_last_answers): what a
    preference answer's tokens are cut from, so DPO, ORPO, SimPO and KTO teach stopping as SFT does."""
    text, rendered, _ = render(tokenizer, messages, fold_system, thinking=thinking)
    if _marks_generation(tokenizer):
        return text
    specials = _special_strings(tokenizer)
    try:
        row = [0, text, answer_spans(tokenizer, rendered, text, specials, thinking), False, rendered]
    except RowError:
        return text  # an answer the template rewrites: its tokens are still what the render adds
    _close_last_answers(tokenizer, [row], specials, thinking)
    return row[1]


def _trained_flags(offsets, spans: list[AnswerSpan]) -> list[bool]:
    """A token is trained when it is not empty and overlaps an answer's span: the test
    `e > s and any(s < span.end and e > span.start)` for every token at once (numpy), since a
    Python loop over every token of every row was most of a big file's X-ray."""
    import numpy as np

    if not spans or not offsets:
        return [False] * len(offsets)
    off = np.asarray(offsets, dtype=np.int64)
    starts, ends = off[:, 0], off[:, 1]
    hit = np.zeros(len(off), dtype=bool)
    for sp in spans:
        hit |= (starts < sp.end) & (ends > sp.start)
    hit &= ends > starts
    return hit.tolist()


def _encode(tokenizer, texts: list[str], offsets: bool) -> dict:
    """One call of the fast tokenizer for many texts (its batch path; a one-text call takes the same
    path): ids, and the character offsets of each token when asked."""
    if not texts:
        return {"input_ids": [], "offset_mapping": []}
    kwargs = {"return_offsets_mapping": True} if offsets else {}
    return tokenizer(
        texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False, **kwargs
    )


def tokenize_examples(
    tokenizer,
    examples: list,
    responses_only: bool = True,
    fold_system: bool = False,
    earlier_reasoning: str = "drop",
    thinking: bool | None = None,
) -> list:
    """tokenize_example for many rows at once: for each example its Tokenized, or the RowError that
    row raises. The same steps, row for row, with what is per tokenizer done once (its special
    strings, whether its template marks generation), the conversations rendered in one call and every
    text tokenized in one fast-tokenizer call (the X-ray of a 354k-row file went from hours to minutes)."""
    specials = _special_strings(tokenizer)
    generation = _marks_generation(tokenizer)
    out: list = [None] * len(examples)
    chats = [i for i, ex in enumerate(examples) if not isinstance(ex, str)]
    texts = [i for i, ex in enumerate(examples) if isinstance(ex, str)]

    plain = _encode(tokenizer, [examples[i] for i in texts], offsets=False)
    eos = tokenizer.eos_token_id
    for i, ids in zip(texts, plain["input_ids"]):
        ids = list(ids) + ([eos] if eos is not None else [])
        out[i] = Tokenized(ids, [True] * len(ids), text=examples[i])

    rendered: list[list] = []  # [row, text, spans, folded, messages rendered]
    for i, got in zip(chats, _render_all(tokenizer, [examples[i] for i in chats], fold_system, thinking)):
        if isinstance(got, RowError):
            out[i] = got
            continue
        text, messages, folded = got
        try:
            if generation:  # the template's own marks; the text tokenized stays the render above
                spans = _generation_spans(tokenizer, messages, specials, thinking)[1]
            else:
                spans = answer_spans(tokenizer, messages, text, specials, thinking)
        except RowError as exc:
            out[i] = exc
            continue
        rendered.append([i, text, spans, folded, messages])
    if not generation:
        _close_last_answers(tokenizer, rendered, specials, thinking)

    enc = _encode(tokenizer, [text for _, text, _, _, _ in rendered], offsets=responses_only)
    for k, (i, text, spans, folded, _) in enumerate(rendered):
        ids = list(enc["input_ids"][k])
        if responses_only:
            trained_spans_ = spans[-1:] if earlier_reasoning == "final_turn_only" else spans
            trained = _trained_flags(enc["offset_mapping"][k], trained_spans_)
        else:
            trained = [True] * len(ids)
        out[i] = Tokenized(ids, trained, spans, folded, text)
    return out


def tokenize_example(
    tokenizer,
    example,
    responses_only: bool = True,
    fold_system: bool = False,
    earlier_reasoning: str = "drop",
    thinking: bool | None = None,
) -> Tokenized:
    """Token ids and trained flags for one row (messages from formats.row_to_messages, or text).
    For earlier_reasoning "keep" this is the whole conversation as rendered (what the window shows);
    tokenize_rows gives the examples training uses. RowError when the template cannot render it.
    `thinking`: the switch passed to the template (thinking_vars; None: its default)."""
    (got,) = tokenize_examples(tokenizer, [example], responses_only, fold_system, earlier_reasoning, thinking)
    if isinstance(got, RowError):
        raise got
    return got


def tokenize_rows(
    tokenizer,
    examples: list,
    responses_only: bool = True,
    fold_system: bool = False,
    earlier_reasoning: str = "drop",
    thinking: bool | None = None,
) -> list:
    """The examples each row trains, for many rows at once (tokenize_examples' batches): for each row
    a list of Tokenized, or the RowError it raises. One example per row, or (earlier_reasoning "keep",
    and the template dropped the reasoning of an earlier answer) one per answer, each ending at its
    answer, which alone is trained, with its reasoning rendered; a row whose part the template
    rejects is that part's RowError."""
    wholes = tokenize_examples(tokenizer, examples, responses_only, fold_system, earlier_reasoning, thinking)
    out: list = [got if isinstance(got, RowError) else [got] for got in wholes]
    if earlier_reasoning != "keep":
        return out
    split = [  # (row, the conversation up to one of its answers)
        (i, example[: k + 1])
        for i, (example, got) in enumerate(zip(examples, wholes))
        if not isinstance(example, str)
        and not isinstance(got, RowError)
        and any(a.reasoning_dropped for a in got.answers)
        for k, msg in enumerate(example)
        if msg["role"] == "assistant"
    ]
    parts = tokenize_examples(
        tokenizer, [part for _, part in split], responses_only, fold_system, "final_turn_only", thinking
    )
    for i in {i for i, _ in split}:
        out[i] = []
    for (i, _), got in zip(split, parts):
        if isinstance(out[i], list):  # the first part the template rejects is the row's error
            out[i] = got if isinstance(got, RowError) else out[i] + [got]
    return out
