"""The engine on the training-method workloads (W10 DPO, W11 GRPO), through the objective a
TrainingSession runs for `training.method` (engine.train.objectives), as bench.ours does for SFT.

A step is what the session's step runner does for one micro-batch: `objective.prepare_step`
(DPO: the reference pass with the adapters off on the same weights; GRPO: the groups sampled
from the policy with a KV cache, scored, and the reference pass), then `objective.loss` through
the run's `Forward` (fast paths, per-token log-probs through the fused head), backward, the
engine's AdamW. The same LoRA, model build and fast-path variants as bench.ours.
"""

from __future__ import annotations

import dataclasses

from bench.runner import Context, NotYetSupported, Prepared, make_ours_optimizer


def _run_config(wl):
    """The RunConfig an objective reads: its method and the workload's method settings."""
    from engine.config import RewardConfig, RunConfig

    cfg = RunConfig()
    cfg.training.method = wl.kind
    x = wl.extra
    if wl.kind == "dpo":
        cfg.preference.beta = float(x["beta"])
    else:
        g = cfg.grpo
        g.group_size, g.max_new_tokens, g.beta = int(x["group"]), int(x["max_new_tokens"]), float(x["beta"])
        g.rewards = [RewardConfig(kind="regex", pattern=x.get("reward_pattern", REWARD_PATTERN))]
    return cfg


# W11's reward: a completion whose text holds a digit (on the bench's random-weight models some
# completions of a group do and some do not, so the advantages are not all zero).
REWARD_PATTERN = r"(?s).*\d.*"


def setup_ours_method(variant: str, fields: dict):
    """bench.ours.setup_ours for kind "dpo" (W10) and "grpo" (W11)."""

    def setup(ctx: Context) -> Prepared:
        import torch

        from bench.ours import loss_fn, prepare_ours
        from bench.workloads import build_model
        from engine.train.objectives.base import Forward, StepContext
        from engine.train.objectives.logps import SequenceBatch

        wl = ctx.workload
        cfg = _run_config(wl)
        cuda = ctx.device.type == "cuda"
        model = build_model(wl, dtype=torch.bfloat16 if cuda else torch.float32, device=ctx.device)
        prepared, fp = prepare_ours(model, wl, ctx.device, fields)
        peft, offloader = prepared.model, prepared.offloader
        _, fused = loss_fn(prepared, fp)
        forward = Forward(
            fused_ce=fused,
            cached_metadata=fp.cached_metadata,
            ce_chunk_tokens=None if fp.ce_chunk_tokens == "auto" else fp.ce_chunk_tokens,
            offloader=lambda: offloader,
        )
        opt, opt_options = make_ours_optimizer([p for p in peft.parameters() if p.requires_grad], ctx.lr)
        if wl.kind == "dpo":
            from engine.train.objectives.dpo import DPO

            objective = DPO(cfg)
            # The collate of the pair objectives: each pair's answers side by side in one packed row.
            host = [
                SequenceBatch.from_sequences([s for p, c, r in b.pairs for s in ((p, c), (p, r))]) for b in ctx.batches
            ]
        else:
            raise NotYetSupported(
                "W11 (GRPO) has no bench harness yet: the objective samples through a tokenizer, and the "
                "random-weight workloads have none for Qwen3's vocabulary"
            )
        extra: dict = {}

        def step(i):
            micro = objective.prepare_step(StepContext(peft, ctx.device, None, forward, i + 1), [(1, host[i])])
            normalizer = objective.normalizer([b for _, b in micro])
            total = 0.0
            for _, batch in micro:
                dev = batch.to(ctx.device)
                out = objective.loss(forward, peft, dev, normalizer)
                out.loss.backward()
                total = total + out.loss.detach()
                dev.info.free()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total

        options = {
            "variant": variant,
            "method": wl.kind,
            "objective": f"{type(objective).__module__}.{type(objective).__name__}",
            "fast_paths": dataclasses.asdict(fp),
            "fast_paths_report": dict(prepared.report),
            "offload": fields.get("offload", "off"),
            "fused_ce": fused,
            "lora_params": sum(p.numel() for p in peft.parameters() if p.requires_grad),
            "optimizer": opt_options,
        }
        return Prepared(step, options, extra, keep=[peft, opt, host, objective])

    return setup
