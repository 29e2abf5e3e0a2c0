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

from bench.runner import Context, Prepared, make_ours_optimizer


def _run_config(wl):
    """The RunConfig an objective reads: its method and the workload's method settings."""
    from engine.config import RunConfig

    cfg = RunConfig()
    cfg.training.method = wl.kind
    x = wl.extra
    if wl.kind == "dpo":
        cfg.preference.beta = float(x["beta"])
    else:
        from bench.grpo_bench import reward_configs

        g = cfg.grpo
        g.group_size, g.max_new_tokens, g.beta = int(x["group"]), int(x["max_new_tokens"]), float(x["beta"])
        g.rewards = reward_configs(wl)  # W11's rewards (bench.grpo_bench: why these)
        # A row holds one prompt and its group's room; the prompts are ~64 tokens (max_tokens at most).
        cfg.data.max_seq_len = int(x["max_tokens"]) + 64
    return cfg


def grpo_prompts(wl, objective, tok, batches) -> list:
    """Each PromptStep as the objective's micro-batch: its prompts' text (bench.grpo_bench) read,
    rendered and tokenized as a run's data is (engine.data.preference, kind "prompts"), collated."""
    from datasets import Dataset

    from bench.grpo_bench import prompt_texts
    from engine.data.preference import prepare_preference_data

    cfg = objective.config
    out = []
    for step in batches:
        raw = Dataset.from_list([{"prompt": t} for t in prompt_texts(step, tok)])
        data = prepare_preference_data(cfg.data, tok, "prompts", extra_tokens=cfg.grpo.max_new_tokens, raw=raw)
        if len(data.examples) != step.num_prompts:
            raise RuntimeError(f"W11 prompts dropped: {data.skipped[:2]}")
        out.append(objective.collate(data, list(range(len(data.examples)))))
    return out


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
        opt, opt_options = make_ours_optimizer(peft, ctx.lr)
        if wl.kind == "dpo":
            from engine.train.objectives.dpo import DPO

            objective = DPO(cfg)
            # The collate of the pair objectives: each pair's answers side by side in one packed row.
            host = [
                SequenceBatch.from_sequences([s for p, c, r in b.pairs for s in ((p, c), (p, r))]) for b in ctx.batches
            ]
        else:
            from bench.grpo_bench import describe_rewards, load_tokenizer
            from engine.train.objectives.grpo import GRPO

            tok = load_tokenizer(ctx.args, wl)
            objective = GRPO(cfg)
            host = grpo_prompts(wl, objective, tok, ctx.batches)
        # GRPO: each step's reward, its spread, the KL and the completions' length (the learning
        # check reads them, bench.grpo_bench.grpo_check); filled in step by step.
        extra: dict = {"reward_curve": [], "reward_std_curve": [], "kl_curve": [], "completion_length_curve": []}
        if wl.kind != "grpo":
            extra, tok = {}, None

        def step(i):
            micro = objective.prepare_step(StepContext(peft, ctx.device, tok, forward, i + 1), [(1, host[i])])
            normalizer = objective.normalizer([b for _, b in micro])
            total, sums = 0.0, {}
            for _, batch in micro:
                dev = batch.to(ctx.device)
                out = objective.loss(forward, peft, dev, normalizer)
                out.loss.backward()
                total = total + out.loss.detach()
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                dev.info.free()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if extra:
                m = objective.step_metrics(sums)
                extra["reward_curve"].append(m["reward"])
                extra["reward_std_curve"].append(m["reward_std"])
                extra["kl_curve"].append(m.get("kl", 0.0))
                extra["completion_length_curve"].append(m["completion_length"])
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
        if wl.kind == "grpo":
            options.update(
                rewards=describe_rewards(wl),
                generation=_generation_way(peft, wl),
                tokenizer=tok.name_or_path,
            )
        return Prepared(step, options, extra, keep=[peft, opt, host, objective])

    return setup


def _generation_way(model, wl) -> str:
    """How GRPO's groups are sampled here: the engine's decode loop, or generate where it refuses."""
    from engine.train.decoding import decode_refusal

    refusal = decode_refusal(model, int(wl.extra.get("max_tokens", 0)) + int(wl.extra["max_new_tokens"]))
    if refusal is None:
        return "the engine's decode loop (engine.train.decoding: preallocated KV cache, CUDA graph), adapters on"
    return f"transformers generate, KV cache, adapters on ({refusal})"
