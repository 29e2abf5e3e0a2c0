"""ORPO (odds-ratio preference optimisation): SFT on the chosen answer plus a log-odds-ratio
term, with no reference model at all.

    loss = NLL(chosen) - beta * log sigmoid(log odds(c) - log odds(r)),  odds(p) = p / (1 - p)

c, r: the policy's mean per-token log-probs of the chosen and rejected completions. As in TRL's
ORPOTrainer, the NLL term is the mean next-token loss over the chosen sequence's every token,
prompt included. Metrics: rewards/* are beta times the mean log-probs (TRL's), plus
log_odds_ratio and nll_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.token_logp import sum_per_document
from engine.train.objectives import register
from engine.train.objectives.base import LossOutput
from engine.train.objectives.logps import completion_means, token_logps
from engine.train.objectives.pairs import PairObjective, chosen_rejected, preference_metrics


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_mean, rejected_mean, chosen_nll, beta: float = 0.1, normalizer=None):
    """chosen_mean / rejected_mean: [pairs] mean completion log-probs; chosen_nll: the chosen
    sequences' NLL term, already a mean. (loss, metric sums)."""
    c, r = chosen_mean.float(), rejected_mean.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    n = ratio.numel() if normalizer is None else normalizer
    loss = chosen_nll - (beta * ratio).sum() / n
    metrics = preference_metrics(beta * c, beta * r, c, r)
    metrics["log_odds_ratio"] = ratio.detach().sum()
    metrics["nll_loss"] = chosen_nll.detach() * ratio.numel()
    return loss, metrics


@register
class ORPO(PairObjective):
    name = "orpo"

    def prepare_step(self, ctx, micro):
        # The NLL term is a mean over the step's chosen targets (prompt included, as TRL's).
        total = sum(sum(n - 1 for n in b.info.lengths[0::2]) for _, b in micro)
        for _, b in micro:
            b.extra["chosen_targets"] = max(1, total)
        return micro

    def loss(self, forward, model, batch, normalizer):
        logps = token_logps(forward, model, batch)
        c, r = chosen_rejected(completion_means(logps, batch))
        whole = sum_per_document(logps, batch.info.lengths, batch.doc_index)
        nll = -whole[0::2].sum() / batch.extra["chosen_targets"]
        return LossOutput(*orpo_loss(c, r, nll, self.beta, normalizer))
