"""Sequences scored by their log-probability: the batch and the forward shared by DPO, ORPO,
SimPO, KTO and GRPO.

Every one of those methods asks the same question of the model: how likely is this completion
after this prompt, token by token and summed. A `SequenceBatch` packs (prompt, completion)
pairs as documents of one packed row (a DPO pair's chosen and rejected answers side by side,
attention kept apart by the packed metadata, no padding), with a mask of which targets are
completion tokens. `token_logps` runs the decoder on the fast paths and takes the per-token
log-probs through the fused head (engine.kernels.token_logp: the [tokens, vocab] logits never
exist on the GPU); `completion_sums` sums them per document.

The reference model is the same model with its adapters off (`StepContext.adapters_off`, or
`adapters_off` here): no second copy of the weights, and the fused LoRA path stays on with the
LoRA term left out (engine.fastpath.lora_group).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.data.collate import IGNORE_INDEX, PackedBatch
from engine.fastpath.packed import PackedSeqInfo


@dataclass
class SequenceBatch(PackedBatch):
    """A PackedBatch of (prompt, completion) documents. `completion` [T] float: 1 where the
    target is a completion token; `prompt_tokens` / `completion_tokens`: per document. `extra`:
    what a method attaches per document (labels, advantages, reference log-probs, ...), moved
    with the batch when they are tensors."""

    completion: Optional[torch.Tensor] = None
    prompt_tokens: list = field(default_factory=list)
    completion_tokens: list = field(default_factory=list)
    doc_index: Optional[torch.Tensor] = None  # int64 [T]: each token's document
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], score_prompt: bool = False, extra=None
    ) -> "SequenceBatch":
        """Pack (prompt ids, completion ids) pairs in order, one document each. A target is
        scored when the token it predicts is a completion token (or any token, with
        `score_prompt`: ORPO's NLL term reads the prompt's too); `completion` marks the first."""
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        ids: list[int] = []
        tgt: list[int] = []
        comp: list[float] = []
        for i, (prompt, answer) in enumerate(sequences):
            doc = [int(t) for t in prompt] + [int(t) for t in answer]
            if not answer:
                raise ValueError(f"sequence {i} of the batch has an empty completion")
            ids.extend(doc)
            for t in range(len(doc) - 1):
                is_comp = t + 1 >= len(prompt)
                tgt.append(doc[t + 1] if (is_comp or score_prompt) else IGNORE_INDEX)
                comp.append(1.0 if is_comp else 0.0)
            tgt.append(IGNORE_INDEX)  # the last token predicts nothing inside its document
            comp.append(0.0)
        lengths = [len(p) + len(a) for p, a in sequences]
        info = PackedSeqInfo.from_lengths(lengths)
        completion_tokens = [len(a) if len(p) else len(a) - 1 for p, a in sequences]
        from engine.kernels.token_logp import document_index

        return cls(
            torch.tensor(ids, dtype=torch.int64).unsqueeze(0),
            torch.tensor(tgt, dtype=torch.int64).unsqueeze(0),
            info,
            len(ids),
            sum(completion_tokens),
            completion=torch.tensor(comp, dtype=torch.float32),
            prompt_tokens=[len(p) for p, _ in sequences],
            completion_tokens=completion_tokens,
            doc_index=document_index(lengths),
            extra=dict(extra or {}),
        )

    def to(self, device) -> "SequenceBatch":
        device = torch.device(device)
        if device.type == "cpu":
            return self
        base = PackedBatch.to(self, device)
        return SequenceBatch(
            base.input_ids,
            base.targets,
            base.info,
            base.num_tokens,
            base.num_trained_tokens,
            base.host_ids,
            completion=self.completion.to(device, non_blocking=True),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            doc_index=self.doc_index.to(device, non_blocking=True),
            extra={k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in self.extra.items()},
        )

    @property
    def num_docs(self) -> int:
        return len(self.completion_tokens)


def token_logps(forward, model, batch: SequenceBatch, logit_scale: float = 1.0) -> torch.Tensor:
    """fp32 [T]: log p(target) at every scored target of the batch, 0 elsewhere.

    `forward`: the run's engine.train.objectives.base.Forward (its `hidden` runs the decoder on
    the fast paths); `logit_scale`: 1 / temperature (GRPO scores at its sampling temperature)."""
    from engine.fastpath.host_head import HostHead
    from engine.kernels.token_logp import fused_linear_token_logp, fused_linear_token_logp_reference

    base, hidden, head = forward.hidden(model, batch)
    if isinstance(head, HostHead):
        raise ValueError(
            "the preference and GRPO methods need the output head on the device: "
            "set fast_paths.host_embeddings to false for this run"
        )
    softcap = getattr(base.config, "final_logit_softcapping", None)
    fn = fused_linear_token_logp if forward.fused_ce else fused_linear_token_logp_reference
    return fn(
        hidden,
        head.weight,
        batch.targets.reshape(-1),
        bias=head.bias,
        ignore_index=IGNORE_INDEX,
        softcap=softcap,
        logit_scale=logit_scale,
        chunk_tokens=forward.ce_chunk_tokens,
    )


def completion_sums(values: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """[docs]: per-token `values` summed over each document's completion targets."""
    from engine.kernels.token_logp import sum_per_document

    return sum_per_document(values * batch.completion, batch.info.lengths, batch.doc_index)


def completion_means(values: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """[docs]: the per-token mean over each document's completion targets (SimPO, ORPO)."""
    counts = torch.tensor(batch.completion_tokens, dtype=torch.float32).clamp_min(1).to(values.device)
    return completion_sums(values, batch) / counts


@contextmanager
def adapters_off(model):
    """The base model alone, without gradients: the reference pass on the same weights. Prefer
    `StepContext.adapters_off` inside a run; this one is for callers without a context."""
    from engine.train.step import PreparedModel

    peft = model.model if isinstance(model, PreparedModel) else model
    with peft.disable_adapter(), torch.no_grad():
        yield


def reference_logps(forward, model, batch: SequenceBatch, logit_scale: float = 1.0) -> torch.Tensor:
    """`token_logps` of the adapter-free base (no autograd), detached fp32 [T]."""
    with adapters_off(model):
        return token_logps(forward, model, batch, logit_scale).detach()
