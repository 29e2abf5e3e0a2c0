"""Chat with a run's result: its base model plus the run's LoRA adapter (engine.api.RunChat),
comparing the fine-tuned reply with the base model's (the adapter switched off for the same
weights, so the two differ only by the adapter).

Everything here runs on a pool thread; one `RunChat` serves one generation at a time.
"""

from __future__ import annotations

from typing import Optional


def load_chat_model(source: str):
    """`source`: a run folder or a checkpoint folder (anything the engine's export accepts)."""
    from engine.api import RunChat

    return RunChat(source, device="auto")


def compare(model, prompt: str, max_new_tokens: int, with_base: bool, tools=None) -> dict[str, Optional[str]]:
    """The fine-tuned reply and (with_base) the base model's, both offered `tools` when given."""
    tuned = model.reply(prompt, max_new_tokens, use_adapter=True, tools=tools)
    base = model.reply(prompt, max_new_tokens, use_adapter=False, tools=tools) if with_base else None
    return {"tuned": tuned, "base": base}
