"""Shared by the preference and GRPO parity tests: a tiny model built from a config (with the demo
tokenizer), the same LoRA on two copies, preference rows, and our training loop that scores
packed sequences through the engine's fast path (engine.train.objectives.logps) so each test
can hold it against a TRL trainer run on the other copy."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.config import FastPathConfig
from engine.resources import DEMO_MODEL_DIR

LR = 5e-3
EPS = 1e-8  # AdamW's eps, set on both sides (TRL's Trainer: adam_epsilon)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", bias="none", task_type="CAUSAL_LM")

ROWS = [
    ("What is 7 plus 5?", "Answer: 12", "Answer: 75"),
    ("Name the capital city of Greece.", "Answer: Athens", "Athens is it"),
    ("What is 10 minus 3?", "Answer: 7", "Answer: 13"),
    ("Write night in capital letters.", "Answer: NIGHT", "night"),
    ("How many letters are in pencil?", "Answer: 6", "Answer: 60"),
    ("What is 30 plus 15?", "Answer: 45", "I do not know"),
    ("Name the capital city of Russia.", "Answer: Moscow", "Answer: Paris"),
    ("What is 6 minus 1?", "Answer: 5", "Answer: 7"),
]


def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def tiny_model(seed=0):
    """A 2-layer Llama built from a config (vocabulary of the demo tokenizer), fp32, with LoRA."""
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    return get_peft_model(model, LoraConfig(**LORA))


def twins(seed=0):
    """Two identical LoRA models: one for TRL, one for the engine."""
    a = tiny_model(seed)
    return a, copy.deepcopy(a)


def prepare(model):
    """The engine's fast paths on the model (CPU), and the run's Forward."""
    from engine.train.objectives.base import Forward
    from engine.train.step import prepare_model

    prepare_model(model, FastPathConfig(), "cpu", gradient_checkpointing=False)
    model.train()
    return Forward()


def optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=0.0)


def trl_args(cls, tmp_path, steps, batch, **kw):
    """The trainer settings both sides share: constant LR, no clipping, no shuffling, fp32 CPU."""
    return cls(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_epsilon=EPS,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # DPOConfig turns it on; the engine side runs without
        bf16=False,  # TRL's configs default to bf16 autocast, on the CPU too
        **kw,
    )


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
