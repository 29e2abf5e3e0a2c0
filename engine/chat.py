"""Chat with a base model or a fine-tuned one (base + PEFT adapter) through its chat template.

`RunChat` is a run's result ready to talk to (the window's Chat page and `tunesmith chat` both
use it); `load_tools` reads the tool definitions a conversation may offer the model.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Optional

from engine.config import ModelConfig


class ChatError(ValueError):
    """What a chat cannot start with: no adapter or run config, a bad tools file. The message
    names the file."""


def load_chat_model(model_cfg: ModelConfig, adapter: str | Path | None = None, device: str = "cpu"):
    """(model, tokenizer) ready for generation; `adapter` is a run, checkpoint or adapter folder.
    `device` "auto" is the CUDA GPU when there is one, else the CPU."""
    from engine.models.loading import load_model, load_tokenizer, quiet_third_party
    from engine.models.lora import keep_lora_targets

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"

    dtype = "float32" if device == "cpu" else "bfloat16"
    cfg = ModelConfig(**{**model_cfg.__dict__, "load_in_4bit": False})
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, device, dtype)
    if adapter is not None:
        from peft import PeftModel

        from engine.export import find_adapter

        with quiet_third_party(), keep_lora_targets():  # PEFT's notices are not the user's to act on
            model = PeftModel.from_pretrained(model, str(find_adapter(adapter)))
    model.eval()
    return model, tokenizer


def chat_prompt(
    tokenizer,
    prompt: str | list[dict],
    thinking: bool | str | None = None,
    tools: Optional[list[dict]] = None,
) -> str:
    """The text a reply is generated after: `prompt` (a user message, or a whole message list)
    through the tokenizer's chat template with the generation prompt. `thinking`: the run's
    data.thinking (its config.yaml), so the prompt opens as training rendered it (Qwen3's empty
    <think></think> with it off, DeepSeek-V3.2's <think> with it on); "auto"/None: the template's
    default. `tools`: tool definitions (`load_tools`) the template writes into the prompt, as
    training rendered a row's `tools` column."""
    from engine.data.render import ensure_chat_template, thinking_vars

    ensure_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    switch = thinking_vars(tokenizer, thinking)
    if tools:
        switch["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **switch)


def generate_reply(
    model,
    tokenizer,
    prompt: str | list[dict],
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    thinking: bool | str | None = None,
    tools: Optional[list[dict]] = None,
    on_text: Optional[Callable[[str], None]] = None,
) -> str:
    """The assistant's reply to `prompt` (see `chat_prompt` for it, `thinking` and `tools`).
    `on_text`: called with each piece of the reply as it is decoded (a terminal shows it as it
    comes); the pieces make the returned reply, less its surrounding whitespace."""
    import torch

    text = chat_prompt(tokenizer, prompt, thinking, tools)
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt").to(model.device)
    sample = temperature > 0
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=None,
            top_k=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            streamer=None if on_text is None else _streamer(tokenizer, on_text),
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _streamer(tokenizer, on_text: Callable[[str], None]):
    """A transformers TextStreamer that hands each decoded piece of the reply to `on_text`."""
    from transformers import TextStreamer

    class _ToCallback(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                on_text(text)

    return _ToCallback(tokenizer, skip_prompt=True, skip_special_tokens=True)


def template_uses_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable (else tools are not in the prompt)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return "tools" in str(template or "")


def load_tools(path: str | Path) -> list[dict]:
    """Tool definitions from a JSON file: a list of OpenAI-style tools ({"type": "function",
    "function": {"name": ..., "parameters": {...}}}) or of bare functions ({"name": ..., ...}), or an
    object with such a list under "tools" (a training row's `tools` column as it is). The entries are
    kept as written, as training hands a row's tools to the template, so the prompt shows them as
    the trained text did. Raises ChatError naming the file and the entry."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ChatError(f"{path}: no such tools file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ChatError(f"{path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        data = data["tools"]
    if not isinstance(data, list) or not data:
        raise ChatError(f'{path}: expected a JSON list of tool definitions (or {{"tools": [...]}})')
    for i, tool in enumerate(data):
        fn = _function(tool)
        name = tool_name(tool)
        if name is None:
            raise ChatError(
                f'{path}: tool {i + 1} has no function name (expected {{"type": "function", "function": '
                f'{{"name": ..., "parameters": {{...}}}}}})'
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatError(f"{path}: tool {i + 1} ({name}): parameters must be a JSON object (a JSON schema)")
    return data


def _function(tool) -> Optional[dict]:
    """The function a tool definition describes: {"type": "function", "function": {...}}'s inner
    object, or the definition itself when it is a bare function ({"name": ..., ...})."""
    if not isinstance(tool, dict):
        return None
    if "function" in tool:
        fn = tool["function"] if tool.get("type", "function") == "function" else None
        return fn if isinstance(fn, dict) else None
    return tool


def tool_name(tool) -> Optional[str]:
    """The name of the function a tool definition describes, or None when it has none."""
    fn = _function(tool)
    name = fn.get("name") if fn is not None else None
    return name if isinstance(name, str) and name.strip() else None


class RunChat:
    """A run's result to talk to: its base model with the run's adapter (`source`: a run,
    checkpoint or adapter folder below a run's config.yaml), prompted with the thinking switch the
    run trained with. `reply` with the adapter switched off is the base model on the same weights,
    so the two differ only by the adapter. One reply at a time (a lock), from any thread."""

    def __init__(self, source: str | Path, device: str = "auto"):
        from engine.export import ExportError, find_adapter, run_config_for

        try:
            self.adapter_dir = find_adapter(source)
        except ExportError as exc:
            raise ChatError(str(exc)) from None
        cfg = run_config_for(self.adapter_dir)
        if cfg is None:
            raise ChatError(f"cannot find the run's config.yaml above {self.adapter_dir}, so the base model is unknown")
        self.base_name = cfg.model.name_or_path
        self.thinking = cfg.data.thinking  # the template's thinking switch the run trained with
        self.model, self.tokenizer = load_chat_model(cfg.model, self.adapter_dir, device=device)
        self.device = str(self.model.device)
        self._lock = threading.Lock()

    def reply(
        self,
        prompt: str | list[dict],
        max_new_tokens: int = 48,
        use_adapter: bool = True,
        tools: Optional[list[dict]] = None,
        temperature: float = 0.0,
        on_text: Optional[Callable[[str], None]] = None,
    ) -> str:
        with self._lock:
            args = (self.model, self.tokenizer, prompt, max_new_tokens, temperature, self.thinking, tools, on_text)
            if use_adapter:
                return generate_reply(*args)
            with self.model.disable_adapter():  # PEFT: the same weights without the adapter
                return generate_reply(*args)
