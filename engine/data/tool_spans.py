"""Where a tool call is in a rendered conversation: the span training marks for an assistant answer
that calls a tool (engine.data.render.answer_spans asks for it).

An answer's text is found by searching the render for it; a call has no text of its own, only what
the chat template writes for it (Qwen's <tool_call> JSON, Llama's bare JSON, Mistral's [TOOL_CALLS],
gpt-oss's channel, GLM's <arg_key> pairs), so its span is found by rendering the conversation before
it and through it and comparing those renders with the whole one.
"""

from __future__ import annotations

import os
import re

from engine.data.render import (
    _GAP,
    _PROBE,
    AnswerSpan,
    RowError,
    _cuts_special,
    _end_marker,
    _find,
    _special_at,
    render,
)

# An empty reasoning block a template writes ahead of an answer given without reasoning (Qwen3's):
# not trained, as for an answer found by its text.
_EMPTY_THINK = re.compile(r"\s*<(?!/)[^<>\s]*think[^<>\s]*>\s*</[^<>\s]*think[^<>\s]*>\s*")


def tool_call_span(tokenizer, messages, k, text, pos, specials, thinking) -> AnswerSpan | None:
    """The span of answer `k`, a tool call: its text is the template's own writing of the call (Qwen's
    <tool_call> JSON, Llama's bare JSON, Mistral's [TOOL_CALLS]), so it is found by rendering, not by
    search. It starts where the generation prompt of the conversation before it ends (past an empty
    reasoning block, which is not trained) and runs as far as the render of the conversation through
    it agrees with `text`: the call and its end-of-turn token. None when the renders disagree before
    the answer; RowError when the call's function names are not in what the template wrote (one with
    no place for tool calls renders an empty answer)."""
    try:
        prompt = render(tokenizer, messages[:k], generation_prompt=True, thinking=thinking)[0]
        through = render(tokenizer, messages[: k + 1], thinking=thinking)[0]
    except RowError:
        return None
    # Where the answer starts: the end of the generation prompt, or, for a template whose prompt opens a
    # reasoning block that its render of a past answer does not hold (DeepSeek-R1's "<think>\n</think>",
    # GLM-4.7's "<think>"), where the two part, not inside a special token.
    opened = len(os.path.commonprefix([prompt, text]))
    if opened < len(prompt):  # parted inside a tag ("<|START_" of <|START_THINKING|> and <|START_ACTION|>)
        while opened > 0 and not (text[opened - 1].isspace() or text[opened - 1] in ">]"):
            opened -= 1
    if opened < pos or not through.startswith(text[:opened]):
        return None

    def past_empty_reasoning(s: str) -> int:
        empty = _EMPTY_THINK.match(s, opened)
        return empty.end() if empty else opened

    # The call may be the render's last answer in `through` and not in `text`, which a template can
    # render apart (Qwen3 writes an empty reasoning block before the last answer only): both are
    # compared from past any such block.
    start, start_through = past_empty_reasoning(text), past_empty_reasoning(through)
    kept = text[start : start + len(os.path.commonprefix([through[start_through:], text[start:]]))].rstrip()
    names = [call["function"]["name"] for call in messages[k]["tool_calls"]]
    if not kept or not all(name in kept for name in names):
        raise RowError(
            f"this chat template does not write tool calls (the call to {names[0]} is not in its render "
            f"of answer {sum(m['role'] == 'assistant' for m in messages[: k + 1])})"
        )
    end = start + len(kept)
    while end > start and _cuts_special(text, end, specials):  # the renders part inside a token
        end -= 1
    eos = getattr(tokenizer, "eos_token", None)
    eos_at = text.find(eos, start, end) if eos else -1
    if eos_at >= 0:  # the turn ends at the EOS; what agrees after it is the next turn's opening
        end = eos_at + len(eos)
    marker, opens_next = _turn_end(tokenizer, specials, thinking)
    if opens_next:
        # A template whose answers end with the next turn's opening token (GLM's <|user|>): the model
        # stops a call at the next turn's, <|observation|>, and is trained to write it.
        gap = _GAP.match(text, end).end()
        nxt = _special_at(text, gap, specials)
        end = nxt if nxt > 0 else end
    elif not _ends_with_special(text, start, end, specials):
        # The render that ends with the call writes it apart from one where more follows (Apriel adds
        # the call's id and its end-of-turn token only then): the span runs on to the template's
        # end-of-turn token, if one comes before the next message's content.
        after = messages[k + 1].get("content") if k + 1 < len(messages) else None
        limit = _find(text, after.strip(), end, specials) if after and after.strip() else -1
        at = _find(text, marker, end, specials) if marker else -1
        if at >= 0 and (limit < 0 or at + len(marker) <= limit):
            end = at + len(marker)
    # The end-of-turn token(s) it closes with: the run of special tokens at its end.
    content_end = end
    while True:
        at = [
            content_end - len(s)
            for s in specials
            if start <= content_end - len(s) and text.startswith(s, content_end - len(s))
        ]
        if not at:
            break
        content_end = min(at)  # the longest special token ending here
    return AnswerSpan(start, end, content_end < end, False, content_end)


def _ends_with_special(text: str, start: int, end: int, specials) -> bool:
    return any(end - len(s) >= start and text.startswith(s, end - len(s)) for s in specials)


_TURN_ENDS: dict[tuple, tuple[str, bool]] = {}


def _turn_end(tokenizer, specials, thinking) -> tuple[str, bool]:
    """(the end-of-turn token(s) this template writes after an answer when the conversation goes on:
    "<|im_end|>", Apriel's "<|end|>", "" for none; whether that token opens the next turn, GLM's
    <|user|>), read off a probe render once per template."""
    key = (getattr(tokenizer, "chat_template", None), thinking if isinstance(thinking, bool) else None)
    if key not in _TURN_ENDS:
        marker, opens_next = "", False
        try:
            text = render(tokenizer, [_PROBE, {"role": "assistant", "content": "Fine."}, _PROBE], thinking=thinking)[0]
            at = _find(text, "Fine.", 0, specials)
            if at >= 0:
                gap = _GAP.match(text, at + len("Fine.")).end()
                end = _end_marker(text, at + len("Fine."), specials, getattr(tokenizer, "eos_token", None))
                if end > gap:
                    marker = text[gap:end]
                    opens_next = text[_GAP.match(text, end).end() :].startswith(_PROBE["content"])
        except RowError:
            pass
        if len(_TURN_ENDS) > 16:
            _TURN_ENDS.clear()
        _TURN_ENDS[key] = (marker, opens_next)
    return _TURN_ENDS[key]
