"""SimPO (simple preference optimisation; TRL's CPOTrainer with loss_type="simpo"): DPO's
sigmoid on length-normalised log-probs with a target margin, and no reference model.

    loss = -log sigmoid(beta * (c - r) - gamma) + alpha * NLL(chosen completion)

c, r: the policy's mean per-token log-probs of the chosen and rejected completions; gamma: the
margin (TRL's simpo_gamma); alpha: CPO's behaviour-cloning weight (TRL's cpo_alpha, 0 in SimPO
proper). Metrics: rewards/* are beta times the mean log-probs (TRL's).
"""

from __future__ import annotations

import torch.nn.functional as F

from engine.train.objectives.dpo import preference_metrics


def simpo_loss(chosen_mean, rejected_mean, beta: float = 2.0, gamma: float = 0.5, normalizer=None):
    """(sum of per-pair losses / normalizer (default: the pairs), metric sums)."""
    losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)
    n = losses.numel() if normalizer is None else normalizer
    return losses.sum() / n, preference_metrics(beta * chosen_mean, beta * rejected_mean, chosen_mean, rejected_mean)
