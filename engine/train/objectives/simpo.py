"""SimPO (simple preference optimisation; TRL's CPOTrainer with loss_type="simpo"): DPO's
sigmoid on length-normalised log-probs with a target margin, and no reference model.

    loss = -log sigmoid(beta * (c - r) - gamma) + alpha * NLL(chosen completion)

c, r: the policy's mean per-token log-probs of the chosen and rejected completions; gamma: the
margin (TRL's simpo_gamma); alpha: CPO's behaviour-cloning weight (TRL's cpo_alpha, 0 in SimPO
proper). Metrics: rewards/* are beta times the mean log-probs (TRL's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.train.objectives import register
from engine.train.objectives.base import LossOutput
from engine.train.objectives.logps import completion_means, completion_sums, token_logps
from engine.train.objectives.pairs import PairObjective, chosen_rejected, preference_metrics


def simpo_loss(chosen_mean, rejected_mean, beta: float = 2.0, gamma: float = 0.5, normalizer=None):
    """(sum of per-pair losses / normalizer (default: the pairs), metric sums)."""
    losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)
    n = losses.numel() if normalizer is None else normalizer
    return losses.sum() / n, preference_metrics(beta * chosen_mean, beta * rejected_mean, chosen_mean, rejected_mean)


@register
class SimPO(PairObjective):
    name = "simpo"

    def loss(self, forward, model, batch, normalizer):
        logps = token_logps(forward, model, batch)
        c, r = chosen_rejected(completion_means(logps, batch))
        pref = self.config.preference
        loss, metrics = simpo_loss(c, r, self.beta, pref.simpo_gamma, normalizer)
        if pref.cpo_alpha:
            # CPO's behaviour-cloning term: the chosen completions' NLL, per pair.
            nll = -chosen_rejected(completion_sums(logps, batch))[0] / _counts(batch)[0::2]
            loss = loss + pref.cpo_alpha * nll.sum() / normalizer
        return LossOutput(loss, metrics)


def _counts(batch):
    return torch.tensor(batch.completion_tokens, dtype=torch.float32, device=batch.completion.device).clamp_min(1)
