"""GRPO as an objective: per prompt, a group sampled from the current policy, scored by the
reward functions, trained with the clipped objective (engine.train.objectives.grpo_loss).

Each example is a prompt (engine.data.preference, kind "prompts"; the row's other columns go to
the reward functions) and each packed row holds one prompt, so a micro-batch of k rows is k
prompts. `prepare_step` then, for each micro-batch:

1. samples `grpo.group_size` completions per prompt with the adapters on, with a KV cache
   (left-padded prompts, one batch of k x G sequences, sampling at `grpo.temperature` /
   `top_p`, no top-k): the engine's decode loop (engine.train.decoding: a preallocated cache,
   the fast paths, the step captured as a CUDA graph, no per-token host sync), or
   transformers' `generate` for a model the loop refuses or a sharded one, the same draws for
   a seed either way (the step's fallbacks then count `decode_loop: <why>`); each completion
   ends at its first end-of-turn token;
2. scores each completion with every reward function (each logged separately) and sums them
   with their weights; advantages are normalised per group;
3. packs the k x G (prompt, completion) documents into one SequenceBatch and, when
   `grpo.beta` > 0, computes the reference log-probs with the adapters off.

What limits generation on a laptop: the KV cache (2 x layers x kv heads x head dim x (prompt +
max_new_tokens) x k x G values, allocated whole at the start, e.g. Qwen3-1.7B, 8 x 512 tokens:
0.9 GiB in bf16) and time: decoding runs one token of every sequence per forward (it reads
every weight once a step: memory-bound), so a step's generation grows with max_new_tokens, not
with the group. The session's rows per micro-batch bounds k.

Each group is used for one optimizer step, so the sampling policy is the policy being trained
(TRL's num_iterations=1): the old log-probs are the current ones detached and the ratio is 1 in
value (its gradient is the policy gradient).

The eval (held-out prompts: data.eval_source, or a data.eval_fraction split as SFT's) answers
each prompt once, greedily (so two evals of the same weights agree and the RNG is untouched),
scores the answers with the same reward functions and reports the mean reward and each
function's mean as EvalMetrics.metrics. Its eval loss is minus the mean reward: the best
checkpoint is the lowest eval loss, so it is the highest reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.counters import count_fallback
from engine.data.collate import PackedBatch
from engine.train.objectives import register
from engine.train.objectives.base import LossOutput, Objective
from engine.train.objectives.grpo_loss import batch_loss, group_advantages
from engine.train.objectives.logps import SequenceBatch, token_logps


@dataclass
class PromptBatch(PackedBatch):
    """A micro-batch before generation: its prompts as documents, which examples they are, and
    the data they come from (their rows feed the reward functions)."""

    example_ids: list = field(default_factory=list)
    data: object = None


def sample_completions(
    model,
    prompts,
    group_size,
    max_new_tokens,
    temperature,
    top_p,
    eos_ids,
    pad_id,
    device,
    greedy=False,
    synced=False,
    report=None,
):
    """[len(prompts) * group_size] completion id lists (each group's consecutive), each cut
    after its first token in `eos_ids`; `greedy`: the most likely token each time (the eval).
    `synced`: a sharded (FSDP) model, whose every forward gathers each layer from all ranks: a
    rank whose sequences have ended keeps stepping until every rank's have (synced_gpus).
    Call with the model in eval mode and no autograd.

    The engine's own decode loop (engine.train.decoding: preallocated KV cache, the fast paths,
    no per-token host sync) runs where it can; a model it refuses, and a sharded one, go
    through transformers' `generate` with the same sampling arithmetic (the same completions
    for a seed). `report`: a dict whose "generate" is then why `generate` sampled (None: the loop did)."""
    from engine.train.decoding import decode, decode_refusal

    width = max(map(len, prompts))
    why = "a sharded (FSDP) model: every rank steps until all have ended" if synced else None
    why = why or decode_refusal(model, width + max_new_tokens)
    if report is not None:
        report["generate"] = why
    if why is None:
        rows = decode(model, prompts, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, device, greedy)
    else:
        rows = generate_completions(
            model, prompts, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, device, greedy, synced
        )
    completions = []
    for row in rows:
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        completions.append(row[:cut] or [pad_id])
    return completions


def generate_completions(
    model, prompts, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, device, greedy=False, synced=False
):
    """transformers' `generate` over left-padded prompts: the generated id lists, uncut. The
    packed attention is switched off around it: it sees no padding mask, so a shorter prompt's
    tokens would read its padding."""
    from engine.fastpath.attention import unpacked_attention

    with unpacked_attention(model):
        return _generate(
            model, prompts, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, device, greedy, synced
        )


def _generate(model, prompts, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, device, greedy, synced):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p}
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        top_k=0 if not greedy else None,
        max_new_tokens=max_new_tokens,
        num_return_sequences=group_size,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
        synced_gpus=synced,
        **sampling,
    )
    return out[:, width:].tolist()


@register
class GRPO(Objective):
    name = "grpo"
    loss_is_progress = False  # ~0 in value each step: the spike check would stop ordinary runs
    # Sampling through the engine's decode loop is asked for; a step that samples through
    # `generate` instead counts fallback:decode_loop with why, and the Monitor shows it.
    fast_paths = {"decode_loop": "on: the engine's decode loop samples the completions where the model allows"}

    def __init__(self, config):
        super().__init__(config)
        self._rewards = None
        self.last_samples: list[dict] = []  # the latest step's completions and rewards

    @property
    def rewards(self):
        if self._rewards is None:
            from engine.train.rewards import build_rewards

            self._rewards = build_rewards(self.config.grpo.rewards)
        return self._rewards

    def prepare_data(self, tokenizer):
        from engine.data.preference import prepare_preference_data

        self.rewards  # a bad reward file stops the run before the model loads  # noqa: B018
        g = self.config.grpo
        return prepare_preference_data(self.config.data, tokenizer, "prompts", extra_tokens=g.max_new_tokens)

    def example_tokens(self, data) -> list[int]:
        g = self.config.grpo
        return [(len(d) + g.max_new_tokens) * g.group_size for d in data.docs]

    def held_out(self, data, tokenizer):
        from engine.train.objectives.pairs import load_held_pairs, split_pairs

        d = self.config.data
        if d.eval_source.strip():
            return data, *load_held_pairs(d, tokenizer, "prompts", extra_tokens=self.config.grpo.max_new_tokens)
        return split_pairs(data, d.eval_fraction, self.config.training.seed)

    def collate(self, data, example_ids):
        batch = PackedBatch.from_documents([data.examples[i][0] for i in example_ids])
        return PromptBatch(
            batch.input_ids, batch.targets, batch.info, batch.num_tokens, 0, example_ids=list(example_ids), data=data
        )

    @staticmethod
    def _eos_pad(tok):
        eos = {tok.eos_token_id} | ({tok.convert_tokens_to_ids("<|im_end|>")} - {None, tok.unk_token_id})
        return eos, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def prepare_step(self, ctx, micro):
        g = self.config.grpo
        tok = ctx.tokenizer
        eos, pad = self._eos_pad(tok)
        out, samples = [], []
        for rows, placeholder in micro:
            ids, data = placeholder.example_ids, placeholder.data
            prompts = [data.examples[i][0] for i in ids]
            sampled: dict = {}
            with ctx.generating():
                completions = sample_completions(
                    ctx.model,
                    prompts,
                    g.group_size,
                    g.max_new_tokens,
                    g.temperature,
                    g.top_p,
                    eos,
                    pad,
                    ctx.device,
                    synced=ctx.synced,
                    report=sampled,
                )
            if sampled["generate"]:  # counted after generating(), which sets its block's counts aside
                count_fallback("decode_loop", sampled["generate"])
            batch, batch_samples = self._score(data, tok, ids, prompts, completions)
            if g.beta:
                dev = batch.to(ctx.device)
                with ctx.adapters_off():
                    batch.extra["ref"] = token_logps(ctx.forward, ctx.model, dev, 1 / g.temperature)
            out.append((rows, batch))
            samples += batch_samples
        self.last_samples = samples
        return out

    def _score(self, data, tok, ids, prompts, completions, group_size=None):
        from engine.train.rewards import score

        g = self.config.grpo
        group = group_size or g.group_size
        spec = data.spec.mapping
        rows, texts, prompt_texts, row_ids = [], [], [], []
        for j, comp in enumerate(completions):
            i = ids[j // group]
            row = dict(data.rows[i])
            prompt_texts.append(row.pop(spec["prompt"]))
            row.pop("completion", None)
            rows.append(row)
            texts.append(tok.decode(comp, skip_special_tokens=True))
            row_ids.append(data.row_ids[i])
        table = torch.tensor(score(self.rewards, prompt_texts, texts, rows, row_ids), dtype=torch.float32)
        weights = torch.tensor([r.weight for r in self.rewards])
        total = (table * weights).sum(1)
        seqs = [(prompts[j // group], c) for j, c in enumerate(completions)]
        batch = SequenceBatch.from_sequences(seqs)
        x = batch.extra
        x["advantages"] = group_advantages(total, group, g.scale_rewards) if group > 1 else torch.zeros_like(total)
        x["reward_sum"], x["reward_sumsq"] = total.sum(), total.square().sum()
        for k, r in enumerate(self.rewards):
            x[f"rewards/{r.name}/sum"], x[f"rewards/{r.name}/sumsq"] = table[:, k].sum(), table[:, k].square().sum()
        x["completion_len_sum"] = torch.tensor(float(sum(map(len, completions))))
        samples = [
            {
                "prompt": p,
                "completion": t,
                "reward": float(total[j]),
                **{r.name: float(table[j, k]) for k, r in enumerate(self.rewards)},
            }
            for j, (p, t) in enumerate(zip(prompt_texts, texts))
        ]
        return batch, samples

    def prepare_eval(self, ctx, batches):
        """The held-out prompts answered greedily (one answer each) and scored: batches whose
        `loss` is minus their rewards (see the module's docstring). Under FSDP every rank
        answers every prompt with the root's weights gathered (each layer gathers itself), and
        the evaluator sums each rank's share of the scored batches."""
        g = self.config.grpo
        eos, pad = self._eos_pad(ctx.tokenizer)
        out = []
        for placeholder in batches:
            ids, data = placeholder.example_ids, placeholder.data
            prompts = [data.examples[i][0] for i in ids]
            with ctx.gathered():
                completions = sample_completions(
                    ctx.model, prompts, 1, g.max_new_tokens, 1.0, 1.0, eos, pad, ctx.device, True, ctx.synced
                )
            batch, _ = self._score(data, ctx.tokenizer, ids, prompts, completions, group_size=1)
            batch.extra["eval"] = True
            out.append(batch)
        return out

    def normalizer(self, batches):
        if batches and isinstance(batches[0], SequenceBatch) and batches[0].extra.get("eval"):
            return max(1, sum(b.num_docs for b in batches))  # the eval: a mean over the answers
        if self.config.grpo.loss_type == "grpo":
            return max(1, sum(b.num_docs for b in batches))
        return max(1, sum(b.num_trained_tokens for b in batches))

    def loss(self, forward, model, batch, normalizer):
        g = self.config.grpo
        x = batch.extra
        if x.get("eval"):  # scored greedy answers (prepare_eval): no forward, minus the reward
            device = batch.input_ids.device
            metrics = {k: v.to(device) for k, v in x.items() if k.startswith("reward") or k == "completion_len_sum"}
            metrics["completions"] = torch.tensor(float(batch.num_docs), device=device)
            return LossOutput(-x["reward_sum"].to(device) / normalizer, metrics)
        logps = token_logps(forward, model, batch, 1 / g.temperature)
        loss, metrics = batch_loss(
            logps,
            batch,
            x["advantages"],
            ref_logps=x.get("ref"),
            beta=g.beta,
            epsilon_low=g.epsilon,
            epsilon_high=g.epsilon_high,
            loss_type=g.loss_type,
            total_completion_tokens=normalizer,
            completions=normalizer,
        )
        for key, value in x.items():
            if key.startswith("reward") or key == "completion_len_sum":
                metrics[key] = value.to(logps.device)
        return LossOutput(loss, metrics)

    def step_metrics(self, sums):
        n = max(sums.get("completions", 0.0), 1.0)

        def spread(total, sq):
            mean = total / n
            return mean, max(sq / n - mean * mean, 0.0) ** 0.5

        out = {}
        out["reward"], out["reward_std"] = spread(sums.get("reward_sum", 0.0), sums.get("reward_sumsq", 0.0))
        for r in self.rewards:
            mean, std = spread(sums.get(f"rewards/{r.name}/sum", 0.0), sums.get(f"rewards/{r.name}/sumsq", 0.0))
            out[f"rewards/{r.name}/mean"], out[f"rewards/{r.name}/std"] = mean, std
        out["completion_length"] = sums.get("completion_len_sum", 0.0) / n
        tokens = max(sums.get("completion_tokens", 0.0), 1.0)
        out["clip_ratio"] = sums.get("clipped_tokens", 0.0) / tokens
        if "kl_sum" in sums:
            out["kl"] = sums["kl_sum"] / tokens
        return out

    def step_samples(self):
        return list(self.last_samples)

    def eval_batches(self, held_out, row_tokens, rows_per_batch):
        n, k = len(held_out), max(1, rows_per_batch)
        return [self.collate(held_out.data, list(range(i, min(i + k, n)))) for i in range(0, n, k)]

    def eval_metrics(self, sums):
        out = self.step_metrics(sums)
        out.pop("clip_ratio", None)  # no policy update in an eval
        return out
