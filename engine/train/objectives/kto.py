"""KTO (Kahneman-Tversky optimisation): unpaired answers, each labelled desirable or not.

    z = clamp(mean over the batch of (KL_policy - KL_ref), min 0), no gradient
    desirable:    w_d * (1 - sigmoid(beta * ((y - y_ref) - z)))
    undesirable:  w_u * (1 - sigmoid(beta * (z - (y - y_ref))))
    loss = mean over the batch's answers

y, y_ref: summed completion log-probs under the policy and under the reference (the base with
adapters off). The KL estimate z comes from mismatched pairs, each prompt with the previous
example's completion (TRL's construction), scored with no gradient under both. Metrics:
rewards/chosen and rewards/rejected (beta times the log-ratio, averaged over their own
answers), logps/chosen, logps/rejected, kl.
"""

from __future__ import annotations

import torch


def kto_loss(
    logps,
    ref_logps,
    labels,
    kl_logps,
    ref_kl_logps,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    normalizer=None,
):
    """logps, ref_logps, labels (bool): [answers]; kl_logps, ref_kl_logps: [mismatched pairs].
    (sum of losses / normalizer (default: the answers), metric sums)."""
    labels = labels.bool()
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    logratios = logps - ref_logps
    losses = torch.where(
        labels,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))),
    )
    n = losses.numel() if normalizer is None else normalizer
    rewards = beta * logratios.detach()
    lab = labels.float()
    metrics = {
        "answers": torch.tensor(float(losses.numel()), device=losses.device),
        "chosen": lab.sum(),
        "rejected": (1 - lab).sum(),
        "rewards/chosen": (rewards * lab).sum(),
        "rewards/rejected": (rewards * (1 - lab)).sum(),
        "logps/chosen": (logps.detach() * lab).sum(),
        "logps/rejected": (logps.detach() * (1 - lab)).sum(),
        "kl": kl * losses.numel(),
    }
    return losses.sum() / n, metrics


def kto_step_metrics(sums: dict) -> dict:
    """Chosen metrics per chosen answer, rejected per rejected, kl per answer."""
    out = {}
    for side in ("chosen", "rejected"):
        n = sums.get(side, 0.0)
        if n:
            out[f"rewards/{side}"] = sums[f"rewards/{side}"] / n
            out[f"logps/{side}"] = sums[f"logps/{side}"] / n
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["kl"] = sums.get("kl", 0.0) / max(sums.get("answers", 0.0), 1.0)
    return out
