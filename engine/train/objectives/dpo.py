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

import torch.nn.functional as F

from engine.train.objectives import register
from engine.train.objectives.base import LossOutput
from engine.train.objectives.logps import completion_sums, token_logps
from engine.train.objectives.pairs import PairObjective, chosen_rejected, preference_metrics


def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta: float = 0.1, normalizer=None):
    """(sum of per-pair losses / normalizer (default: the pairs), metric sums). All [pairs]."""
    chosen_logratios = chosen - ref_chosen
    rejected_logratios = rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    n = losses.numel() if normalizer is None else normalizer
    metrics = preference_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen, rejected)
    return losses.sum() / n, metrics


@register
class DPO(PairObjective):
    name = "dpo"
    needs_reference = True

    def loss(self, forward, model, batch, normalizer):
        c, r = chosen_rejected(completion_sums(token_logps(forward, model, batch), batch))
        rc, rr = chosen_rejected(batch.extra["ref"])
        return LossOutput(*dpo_loss(c, r, rc, rr, self.beta, normalizer))
