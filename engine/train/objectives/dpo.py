"""DPO (direct preference optimisation, sigmoid loss): prefer the chosen answer over the
rejected one by more than the reference model does.

    loss = -log sigmoid(beta * ((c - c_ref) - (r - r_ref)))

c, r: the policy's summed log-probs of the chosen and rejected completions; c_ref, r_ref: the
same under the reference, which is the base with its adapters off in the same process.

The reference log-probs are computed per step, in `prepare_step`, with the adapters off and no
autograd: one extra forward (no backward) over the step's rows, about a third of a step's time,
and no memory beyond one forward's activations (freed before the step's own forwards). Caching
them once before training would save that forward but cost a pass over the whole data set
before the first step, and the cache would go stale when the data or the model changes, so
per-step it is.

Metrics follow TRL's names: rewards/chosen, rewards/rejected (beta times the log-ratio),
rewards/margins, rewards/accuracies (chosen reward above rejected), logps/chosen, logps/rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta: float = 0.1, normalizer=None):
    """(sum of per-pair losses / normalizer (default: the pairs), metric sums). All [pairs]."""
    chosen_logratios = chosen - ref_chosen
    rejected_logratios = rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    n = losses.numel() if normalizer is None else normalizer
    metrics = preference_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen, rejected)
    return losses.sum() / n, metrics
