"""Chat with a base model or a fine-tuned one (base + PEFT adapter) through its chat template."""

from __future__ import annotations

from pathlib import Path

from engine.config import ModelConfig


def load_chat_model(model_cfg: ModelConfig, adapter: str | Path | None = None, device: str = "cpu"):
    """(model, tokenizer) ready for generation; `adapter` is a run, checkpoint or adapter folder.
    `device` "auto" is the CUDA GPU when there is one, else the CPU."""
    from engine.models.loading import load_model, load_tokenizer

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

        model = PeftModel.from_pretrained(model, str(find_adapter(adapter)))
    model.eval()
    return model, tokenizer


def generate_reply(
    model,
    tokenizer,
    prompt: str | list[dict],
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    thinking: bool | str | None = None,
) -> str:
    """The assistant's reply to `prompt` (a user message, or a whole message list). `thinking`: the
    run's data.thinking (its config.yaml), so the prompt opens as training rendered it (Qwen3's
    empty <think></think> with it off, DeepSeek-V3.2's <think> with it on); "auto"/None: the
    template's default."""
    import torch

    from engine.data.render import ensure_chat_template, thinking_vars

    ensure_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    switch = thinking_vars(tokenizer, thinking)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **switch)
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
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
