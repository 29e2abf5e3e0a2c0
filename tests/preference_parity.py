"""Shared by the preference and GRPO parity tests: a tiny model built from a config (with the demo
tokenizer), the same LoRA on two copies, preference rows, and our training loop that scores
packed sequences through the engine's fast path (engine.train.objectives.logps) so each test
can hold it against a TRL trainer run on the other copy.

`trl_run(method, setting, dir)` trains TRL's trainer for DPO, ORPO, SimPO (CPOTrainer) or KTO on
one twin and `our_run(method, setting, model, data)` the other twin through the engine; a
`Setting` says where (CPU or CUDA), how many steps and in which dtype. The CPU suite
(tests/engine/train/test_preference_parity.py) runs 6 fp32 steps, the GPU tier
(tests/gpu/test_preference_parity_gpu.py) 30 on CUDA: the same code.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer

from engine.config import FastPathConfig
from engine.resources import DEMO_MODEL_DIR
from tests.tiny_models import tiny_model as build_tiny

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


def tiny_model(seed=0, dtype=torch.float32):
    """A 2-layer Llama built from a config (vocabulary of the demo tokenizer), with LoRA; fp32
    unless `dtype` says otherwise (built in fp32 from the seed, then cast: the same weights)."""
    model = build_tiny(
        "llama",
        seed=seed,
        dtype=dtype,
        vocab_size=1024,
        intermediate_size=128,
        pad_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return get_peft_model(model, LoraConfig(**LORA))


def twins(seed=0, dtype=torch.float32):
    """Two identical LoRA models: one for TRL, one for the engine."""
    a = tiny_model(seed, dtype)
    return a, copy.deepcopy(a)


def prepare(model, device="cpu"):
    """The engine's fast paths on the model (on `device`: the Triton kernels on CUDA), and the
    run's Forward."""
    from engine.train.objectives.base import Forward
    from engine.train.step import prepare_model

    model.to(device)
    prepare_model(model, FastPathConfig(), device, gradient_checkpointing=False)
    model.train()
    return Forward()


def optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=0.0)


def trl_args(cls, tmp_path, steps, batch, device="cpu", **kw):
    """The trainer settings both sides share: constant LR, no clipping, no shuffling, no autocast
    (the model's own dtype), on the CPU or the GPU."""
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
        use_cpu=device == "cpu",
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


# -- the four preference methods, both sides ----------------------------------------------------

PAIRS = 2  # pairs per step (8 rows: the run goes round the data set in order)
KTO_BATCH = 4  # unpaired rows per step (a chosen and a rejected answer of two prompts)
BETA = 0.1  # DPO, ORPO, KTO
SIMPO = dict(beta=2.0, gamma=0.5)
METHODS = ("dpo", "orpo", "simpo", "kto")
WITH_REFERENCE = ("dpo", "kto")  # the methods whose loss reads the adapter-free reference
# method -> (module, config class, trainer class, rows per step, config settings)
TRL_TRAINERS = {
    "dpo": ("trl", "DPOConfig", "DPOTrainer", PAIRS, dict(beta=BETA)),
    "orpo": ("trl.experimental.orpo", "ORPOConfig", "ORPOTrainer", PAIRS, dict(beta=BETA)),
    "simpo": (
        "trl.experimental.cpo",
        "CPOConfig",
        "CPOTrainer",
        PAIRS,
        dict(beta=SIMPO["beta"], loss_type="simpo", cpo_alpha=0.0, simpo_gamma=SIMPO["gamma"]),
    ),
    "kto": ("trl", "KTOConfig", "KTOTrainer", KTO_BATCH, dict(beta=BETA)),
}


@dataclass(frozen=True)
class Setting:
    """Where and how long a parity run goes: the CPU suite's 6 steps, the GPU tier's 30 on CUDA.
    `dtype` is the twins' weight dtype (TRL gets no autocast: both sides compute in it)."""

    device: str = "cpu"
    steps: int = 6
    dtype: torch.dtype = torch.float32


def trl_run(method: str, setting: Setting, out_dir):
    """TRL's trainer for `method` on one twin: (its log {"loss", "margins"} per step, its tokenized
    train data set, the untouched twin for our side, the trained twin)."""
    if method not in TRL_TRAINERS:
        raise ValueError(f"no TRL trainer for {method!r}")
    module, config, trainer_cls, batch, kw = TRL_TRAINERS[method]
    Config, Trainer = (getattr(importlib.import_module(module), n) for n in (config, trainer_cls))
    theirs, ours = twins(dtype=setting.dtype)
    args = trl_args(Config, out_dir, setting.steps, batch, setting.device, **kw)
    if method == "kto":  # unpaired: each pair's chosen answer labelled good, its rejected one bad
        rows = []
        for p, c, r in ROWS:
            rows += [dict(prompt=p, completion=c, label=True), dict(prompt=p, completion=r, label=False)]
    else:
        rows = [dict(prompt=p, chosen=c, rejected=r) for p, c, r in ROWS]
    trainer = Trainer(model=theirs, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer())
    trainer.train()
    log = {"loss": logged(trainer, "loss")}
    if method == "kto":  # KTOTrainer logs each side's reward, not their margin
        log["margins"] = [c - r for c, r in zip(logged(trainer, "rewards/chosen"), logged(trainer, "rewards/rejected"))]
    else:
        log["margins"] = logged(trainer, "rewards/margins")
    return log, trainer.train_dataset, ours, theirs


def matches(ours: dict, theirs: dict, loss_rtol: float, margin_rtol: float) -> bool:
    """Per-step loss within loss_rtol of TRL's, margins within margin_rtol of TRL's run's largest
    margin (a margin starts at 0, so a per-step relative bound would mean nothing early)."""
    if len(ours["loss"]) != len(theirs["loss"]):
        return False
    scale = max(max(abs(m) for m in theirs["margins"]), 1e-6)
    for a, b in zip(ours["loss"], theirs["loss"]):
        if abs(a - b) > loss_rtol * max(abs(b), 1e-6):
            return False
    return all(abs(a - b) <= margin_rtol * scale for a, b in zip(ours["margins"], theirs["margins"]))


def our_run(method: str, setting: Setting, model, data, adapters_on: bool = False) -> dict:
    """Our side: `model` trained on TRL's tokenized `data`, in TRL's order, through the engine
    (packed sequences, fast paths, fused per-token log-probs, engine.train.objectives' losses);
    AdamW as TRL's Trainer sets it. `adapters_on`: the broken variant whose reference pass keeps
    the adapters on (DPO and KTO; the others have no reference). Returns {"loss", "margins"}."""
    if adapters_on and method not in WITH_REFERENCE:
        raise ValueError(f"{method} has no reference pass")
    loss_of = {"dpo": _dpo_loss, "orpo": _orpo_loss, "simpo": _simpo_loss, "kto": _kto_loss}[method]
    forward = prepare(model, setting.device)
    opt = optimizer(model)
    out = {"loss": [], "margins": []}
    for step in range(setting.steps):
        loss, metrics = loss_of(forward, model, data, step, setting.device, adapters_on)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out["loss"].append(loss.item())
        out["margins"].append(metrics["rewards/margins"].item() / metrics["pairs"].item())
    return out


def _rows(data, step, n):
    return [data[(step * n + i) % len(data)] for i in range(n)]


def _reference(forward, model, batch, adapters_on: bool):
    """The reference log-probs: the base with adapters off, or (the broken variant) the policy."""
    from engine.train.objectives.logps import token_logps

    if adapters_on:
        with torch.no_grad():
            return token_logps(forward, model, batch)
    with model.disable_adapter(), torch.no_grad():
        return token_logps(forward, model, batch)


def _dpo_loss(forward, model, data, step, device, adapters_on):
    from engine.train.objectives.dpo import dpo_loss
    from engine.train.objectives.logps import SequenceBatch, completion_sums, token_logps

    rows = _rows(data, step, PAIRS)
    seqs = []  # each pair's chosen and rejected completions side by side in one packed row
    for r in rows:
        seqs += [(r["prompt_ids"], r["chosen_ids"]), (r["prompt_ids"], r["rejected_ids"])]
    batch = SequenceBatch.from_sequences(seqs)
    assert batch.info.lengths == [len(p) + len(c) for p, c in seqs]
    batch = batch.to(device)
    ref = completion_sums(_reference(forward, model, batch, adapters_on), batch)
    logps = completion_sums(token_logps(forward, model, batch), batch)
    return dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=BETA)


def _split(ids, labels):
    p = next(i for i, lab in enumerate(labels) if lab != -100)
    return ids[:p], ids[p:]


def _paired(rows, score_prompt, device):
    """ORPO's and CPO's rows (prompt and answer tokenized together, the prompt's labels -100) as
    (prompt, answer) documents, chosen and rejected side by side."""
    from engine.train.objectives.logps import SequenceBatch

    seqs = []
    for r in rows:
        seqs += [
            _split(r["chosen_input_ids"], r["chosen_labels"]),
            _split(r["rejected_input_ids"], r["rejected_labels"]),
        ]
    return SequenceBatch.from_sequences(seqs, score_prompt=score_prompt).to(device)


def _orpo_loss(forward, model, data, step, device, adapters_on):
    from engine.kernels.token_logp import sum_per_document
    from engine.train.objectives.logps import completion_means, token_logps
    from engine.train.objectives.orpo import orpo_loss

    batch = _paired(_rows(data, step, PAIRS), True, device)
    logps = token_logps(forward, model, batch)
    means = completion_means(logps, batch)
    whole = sum_per_document(logps, batch.info.lengths, batch.doc_index)  # prompt + answer
    chosen_targets = sum(n - 1 for n in batch.info.lengths[0::2])
    nll = -whole[0::2].sum() / chosen_targets
    return orpo_loss(means[0::2], means[1::2], nll, beta=BETA)


def _simpo_loss(forward, model, data, step, device, adapters_on):
    from engine.train.objectives.logps import completion_means, token_logps
    from engine.train.objectives.simpo import simpo_loss

    batch = _paired(_rows(data, step, PAIRS), False, device)
    means = completion_means(token_logps(forward, model, batch), batch)
    return simpo_loss(means[0::2], means[1::2], **SIMPO)


def _kto_loss(forward, model, data, step, device, adapters_on):
    from engine.train.objectives.kto import kto_loss
    from engine.train.objectives.logps import SequenceBatch, completion_sums, token_logps

    rows = _rows(data, step, KTO_BATCH)
    batch = SequenceBatch.from_sequences([(r["prompt_ids"], r["completion_ids"]) for r in rows]).to(device)
    # TRL's KL estimate: each prompt with the previous example's completion, no gradient.
    kl_batch = SequenceBatch.from_sequences([(r["prompt_ids"], r["KL_completion_ids"]) for r in rows]).to(device)
    with torch.no_grad():
        kl = completion_sums(token_logps(forward, model, kl_batch), kl_batch)
    ref = completion_sums(_reference(forward, model, batch, adapters_on), batch)
    ref_kl = completion_sums(_reference(forward, model, kl_batch, adapters_on), kl_batch)
    logps = completion_sums(token_logps(forward, model, batch), batch)
    labels = torch.tensor([bool(r["label"]) for r in rows], device=device)
    loss, m = kto_loss(logps, ref, labels, kl, ref_kl, beta=BETA)
    chosen, rejected = m["chosen"].item(), m["rejected"].item()
    margin = m["rewards/chosen"] / chosen - m["rewards/rejected"] / rejected
    return loss, {"rewards/margins": margin, "pairs": torch.tensor(1.0)}
