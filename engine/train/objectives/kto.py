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

from engine.train.objectives import register
from engine.train.objectives.base import LossOutput
from engine.train.objectives.logps import SequenceBatch, completion_sums, token_logps
from engine.train.objectives.pairs import PairObjective


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


@register
class KTO(PairObjective):
    """Unpaired answers; each example is (prompt, completion, KL twin) with its label."""

    name = "kto"
    data_kind = "unpaired"

    def collate(self, data, example_ids: list[int]):
        batch = SequenceBatch.from_sequences([data.examples[i][:2] for i in example_ids])
        batch.extra["labels"] = torch.tensor([data.labels[i] for i in example_ids])
        # Scored with no gradient in prepare_step: the KL estimate's mismatched pairs.
        batch.extra["kl_batch"] = SequenceBatch.from_sequences(
            [(data.examples[i][0], data.examples[i][2]) for i in example_ids]
        )
        return batch

    def normalizer(self, batches: list) -> int:
        return max(1, sum(b.num_docs for b in batches))

    def prepare_step(self, ctx, micro):
        for _, batch in micro:
            self._score(ctx, batch, batch.extra.pop("kl_batch"))
        return micro

    def prepare_eval(self, ctx, batches):
        # The policy's KL estimate moves with the adapters: scored again at every eval; the
        # reference's log-probs (the base, adapters off) are computed at the first and kept.
        for batch in batches:
            self._score(ctx, batch, batch.extra["kl_batch"], reference="ref" not in batch.extra)
        return batches

    @staticmethod
    def _score(ctx, batch, kl_host, reference: bool = True) -> None:
        """The KL twins' log-probs under the policy and, with `reference`, the answers' and the
        twins' under the base (adapters off), attached to `batch.extra`; no gradient."""
        dev, kl_dev = batch.to(ctx.device), kl_host.to(ctx.device)
        with ctx.gathered(), torch.no_grad():  # FSDP: the model is called directly, not through its root
            batch.extra["kl"] = completion_sums(token_logps(ctx.forward, ctx.model, kl_dev), kl_dev)
        if reference:
            with ctx.adapters_off():
                batch.extra["ref"] = completion_sums(token_logps(ctx.forward, ctx.model, dev), dev)
                batch.extra["ref_kl"] = completion_sums(token_logps(ctx.forward, ctx.model, kl_dev), kl_dev)
        kl_dev.info.free()

    def loss(self, forward, model, batch, normalizer):
        p = self.config.preference
        logps = completion_sums(token_logps(forward, model, batch), batch)
        x = batch.extra
        return LossOutput(
            *kto_loss(
                logps,
                x["ref"],
                x["labels"],
                x["kl"],
                x["ref_kl"],
                self.beta,
                p.desirable_weight,
                p.undesirable_weight,
                normalizer,
            )
        )

    def step_metrics(self, sums):
        return kto_step_metrics(sums)
