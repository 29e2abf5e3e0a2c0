"""The conversation corpus both halves of the conformance suite use: system prompts, multi-turn,
answers with markdown and code, and reasoning (Qwen3 / DeepSeek-R1 style `<think>` blocks inside the
assistant's content, which those templates parse). Contents carry no leading or trailing blanks, so
a template that trims (Llama-3) renders them unchanged.

CONVERSATIONS: name -> list of messages. `REASONING` names the ones with `<think>` blocks (only for
families whose template understands them); `WITH_SYSTEM` the ones that open with a system prompt.
"""

from __future__ import annotations


def _chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


CONVERSATIONS: dict[str, list[dict]] = {
    "single": _chat(("user", "Why is the sky blue?"), ("assistant", "Air scatters blue light more than red light.")),
    "system_single": _chat(
        ("system", "You are a terse geography tutor."),
        ("user", "Capital of Peru?"),
        ("assistant", "Lima."),
    ),
    "multi_turn": _chat(
        ("user", "Name a volcano in Italy."),
        ("assistant", "Mount Etna, on Sicily."),
        ("user", "Is it active?"),
        ("assistant", "Yes: it is one of the most active volcanoes in the world."),
        ("user", "When did it last erupt?"),
        ("assistant", "It erupts every few years; check a volcano observatory for the latest."),
    ),
    "system_multi_turn": _chat(
        ("system", "You answer in one sentence.\nNever use lists."),
        ("user", "What does a compiler do?"),
        ("assistant", "It translates source code into machine code."),
        ("user", "And an interpreter?"),
        ("assistant", "It runs the source code directly, statement by statement."),
    ),
    "code_answer": _chat(
        ("user", "Write a Python function that adds two numbers."),
        ("assistant", "```python\ndef add(a, b):\n    return a + b\n```\n\nCall it as `add(2, 3)`."),
    ),
    "answer_repeats_prompt": _chat(
        ("user", "Say OK."),
        ("assistant", "OK"),
        ("user", "Say OK again."),
        ("assistant", "OK"),
    ),
    "unicode": _chat(
        ("user", "Translate 'good morning' into French and Japanese."),
        ("assistant", "Bonjour — おはようございます。"),
    ),
    "reasoning_single": _chat(
        ("user", "What is 17 times 3?"),
        ("assistant", "<think>\n17 times 3 is 51.\n</think>\n\n17 × 3 = 51."),
    ),
    "reasoning_multi_turn": _chat(
        ("system", "You are a careful maths tutor."),
        ("user", "Is 91 prime?"),
        ("assistant", "<think>\n91 = 7 × 13.\n</think>\n\nNo: 91 = 7 × 13."),
        ("user", "Is 97 prime?"),
        ("assistant", "<think>\nNo prime up to 9 divides 97.\n</think>\n\nYes, 97 is prime."),
    ),
    "reasoning_then_plain": _chat(
        ("user", "Is 2 even?"),
        ("assistant", "<think>\n2 divided by 2 is 1.\n</think>\n\nYes."),
        ("user", "Thanks!"),
        ("assistant", "You're welcome."),
    ),
}

REASONING = frozenset(name for name, msgs in CONVERSATIONS.items() if any("<think>" in m["content"] for m in msgs))
WITH_SYSTEM = frozenset(name for name, msgs in CONVERSATIONS.items() if msgs[0]["role"] == "system")
