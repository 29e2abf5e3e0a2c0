"""Chat with a run's result: its base model plus the run's LoRA adapter, through engine.api's
load_chat_model / generate_reply, comparing the fine-tuned reply with the base model's (the
adapter switched off for the same weights, so the two differ only by the adapter).

Everything here runs on a pool thread; one `ChatModel` serves one generation at a time.
"""

from __future__ import annotations

import threading
from typing import Optional


class ChatModel:
    def __init__(self, source: str):
        """`source`: a run folder or a checkpoint folder (anything the engine's export accepts)."""
        from engine.api import find_adapter, load_chat_model, run_config_for

        self.adapter_dir = find_adapter(source)
        cfg = run_config_for(self.adapter_dir)
        if cfg is None:
            raise RuntimeError(
                f"cannot find the run's config.yaml above {self.adapter_dir}, so the base model is unknown"
            )
        self.base_name = cfg.model.name_or_path
        self.thinking = cfg.data.thinking  # the template's thinking switch the run trained with
        self.model, self.tokenizer = load_chat_model(cfg.model, self.adapter_dir, device="auto")
        self.device = str(self.model.device)
        self._lock = threading.Lock()

    def generate(self, prompt: str, max_new_tokens: int = 48, use_adapter: bool = True) -> str:
        from engine.api import generate_reply

        with self._lock:
            if use_adapter:
                return generate_reply(self.model, self.tokenizer, prompt, max_new_tokens, thinking=self.thinking)
            with self.model.disable_adapter():  # PEFT: the same weights without the adapter
                return generate_reply(self.model, self.tokenizer, prompt, max_new_tokens, thinking=self.thinking)


def load_chat_model(source: str) -> ChatModel:
    return ChatModel(source)


def compare(model: ChatModel, prompt: str, max_new_tokens: int, with_base: bool) -> dict[str, Optional[str]]:
    tuned = model.generate(prompt, max_new_tokens, use_adapter=True)
    base = model.generate(prompt, max_new_tokens, use_adapter=False) if with_base else None
    return {"tuned": tuned, "base": base}
