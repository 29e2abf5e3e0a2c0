"""What DPO, ORPO and SimPO share as objectives: pairs read and packed, the pair batch, the
per-step reference pass, and per-pair metrics. Each method's module adds only its loss.

A pair is one example: its chosen and rejected completions are two documents of the same packed
row (`SequenceBatch`, chosen first), so a pair never straddles rows and the packed attention
needs no padding. The step's normalizer is its number of pairs: every forward divides its summed
per-pair losses by it, so gradient accumulation equals one large batch.
"""

from __future__ import annotations

import torch

from engine.train.objectives.base import Objective
from engine.train.objectives.logps import SequenceBatch, completion_sums, token_logps

AUTO_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1}


def preference_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    """Sums over the batch's pairs (the session adds forwards up; `per_pair` divides)."""
    cr, rr = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "pairs": torch.tensor(float(cr.numel()), device=cr.device),
        "rewards/chosen": cr.sum(),
        "rewards/rejected": rr.sum(),
        "rewards/margins": (cr - rr).sum(),
        "rewards/accuracies": (cr > rr).float().sum(),
        "logps/chosen": chosen_logps.detach().sum(),
        "logps/rejected": rejected_logps.detach().sum(),
    }


def per_pair(sums: dict) -> dict:
    """Step metrics from summed preference metrics: every sum divided by the pairs counted."""
    n = max(sums.get("pairs", 0.0), 1.0)
    return {k: v / n for k, v in sums.items() if k != "pairs"}


class PairObjective(Objective):
    """Paired preference data; `needs_reference` adds the reference pass in `prepare_step`."""

    needs_reference = False

    @property
    def beta(self) -> float:
        b = self.config.preference.beta
        return AUTO_BETA[self.name] if b == "auto" else float(b)

    def prepare_data(self, tokenizer):
        from engine.data.preference import prepare_preference_data

        return prepare_preference_data(self.config.data, tokenizer, "paired")

    def held_out(self, data, tokenizer):
        return data, None, "no held-out split for preference runs (the eval loss is SFT's)"

    def collate(self, data, example_ids: list[int]):
        seqs = []
        for i in example_ids:
            p, c, r = data.examples[i]
            seqs += [(p, c), (p, r)]
        return SequenceBatch.from_sequences(seqs, score_prompt=self.name == "orpo")

    def normalizer(self, batches: list) -> int:
        return max(1, sum(b.num_docs // 2 for b in batches))

    def prepare_step(self, ctx, micro: list) -> list:
        if not self.needs_reference:
            return micro
        # The reference: the same weights with the adapters off, per step (see dpo.py for why).
        with ctx.adapters_off():
            for _, batch in micro:
                dev = batch.to(ctx.device)
                batch.extra["ref"] = completion_sums(token_logps(ctx.forward, ctx.model, dev), dev).detach()
                dev.info.free()
        return micro

    def step_metrics(self, sums):
        return per_pair(sums)

    def eval_batches(self, held_out, row_tokens, rows_per_batch):
        return []


def chosen_rejected(values: torch.Tensor):
    """Per-document values of a pair batch -> (chosen, rejected)."""
    return values[0::2], values[1::2]
