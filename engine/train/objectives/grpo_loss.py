"""GRPO's math: group-normalised advantages and the clipped objective with a KL term.

Per prompt, a group of G completions is sampled from the current policy and scored by the
reward functions; each completion's advantage is its reward minus the group's mean, divided by
the group's standard deviation (Bessel-corrected, + 1e-4; scale "batch" uses the whole batch's
spread, "none" does not divide). Then, per completion token t,

    ratio = exp(logp_t - old_logp_t)            old: the sampling policy (= logp detached when
                                                 each group is used for one step)
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * kl_t
    kl_t   = ratio * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   (k3 estimator, ratio-corrected;
                                                                    ref: the base, adapters off)

aggregated as TRL does: "grpo" averages each completion's tokens then the completions, "bnpo"
and "dapo" divide the sum over every completion token by their count. beta = 0 skips the
reference pass altogether.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """[N] rewards of N / group_size groups (each group's completions consecutive) -> [N]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(1, keepdim=True)
    adv = (grouped - mean).reshape(-1)
    if scale == "none":
        return adv
    if scale == "group":
        std = grouped.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        std = std.expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = rewards.float().std().expand_as(adv) if rewards.numel() > 1 else torch.zeros_like(adv)
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected group, batch or none")
    return adv / (std + 1e-4)


def grpo_token_loss(
    logps: torch.Tensor,
    advantages_per_token: torch.Tensor,
    old_logps=None,
    ref_logps=None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
):
    """Per-token loss [T] (unmasked), its KL [T] (or None) and whether each token was clipped [T]."""
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages_per_token, clipped * advantages_per_token)
    kl = None
    if beta != 0.0:
        delta = ref_logps - logps
        # The k3 estimate under the sampling policy, weighted by the ratio to the current one
        # (TRL's use_bias_correction_kl, on by default): unbiased once the policy has moved.
        kl = (torch.exp(delta) - delta - 1) * ratio
        loss = loss + beta * kl
    was_clipped = (ratio * advantages_per_token) != (clipped * advantages_per_token)
    return loss, kl, was_clipped


def aggregate(per_token: torch.Tensor, batch, loss_type: str, total_completion_tokens=None, completions=None):
    """The batch's share of the step's loss. "grpo": sum over completions of their token mean,
    divided by `completions` (the step's count); "bnpo"/"dapo": sum over tokens divided by
    `total_completion_tokens` (the step's count)."""
    from engine.train.objectives.logps import completion_means, completion_sums

    if loss_type == "grpo":
        n = batch.num_docs if completions is None else completions
        return completion_means(per_token, batch).sum() / n
    if loss_type in ("bnpo", "dapo"):
        n = batch.num_trained_tokens if total_completion_tokens is None else total_completion_tokens
        return completion_sums(per_token, batch).sum() / max(n, 1)
    raise ValueError(f"unknown GRPO loss type {loss_type!r}; expected grpo, bnpo or dapo")


def batch_loss(
    logps: torch.Tensor,
    batch,
    advantages: torch.Tensor,
    old_logps=None,
    ref_logps=None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "dapo",
    total_completion_tokens=None,
    completions=None,
):
    """One SequenceBatch's share of the step's GRPO loss, and metric sums (completions,
    completion tokens, KL and clipped tokens summed over completion tokens).

    `logps`, `old_logps`, `ref_logps`: per-token [T] over the packed batch; `advantages`: one
    per document (completion)."""
    adv_t = advantages.to(logps.device)[batch.doc_index]
    per_token, kl, clipped = grpo_token_loss(logps, adv_t, old_logps, ref_logps, beta, epsilon_low, epsilon_high)
    loss = aggregate(per_token, batch, loss_type, total_completion_tokens, completions)
    mask = batch.completion
    metrics = {
        "completions": torch.tensor(float(batch.num_docs), device=logps.device),
        "completion_tokens": mask.sum(),
        "clipped_tokens": (clipped.float() * mask).sum(),
    }
    if kl is not None:
        metrics["kl_sum"] = (kl.detach() * mask).sum()
    return loss, metrics
