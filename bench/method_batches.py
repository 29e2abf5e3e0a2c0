"""W10's preference pairs and W11's prompts: the same learnable data for every implementation.

A DPO step (`PairStep`) holds `pairs` (prompt, chosen, rejected) triples of token ids. Prompt and
answer lengths are drawn from log-normals around the workload's means (W10: prompt ~256, each
answer ~384 tokens), a pair's prompt + longer answer at most `max_tokens` (1,024). The prompt and
the chosen answer are one run of the workload's Markov chain (bench.batches: one chain per
vocabulary), the chosen answer continuing the prompt; the rejected answer is drawn uniformly from
the chain's id set. A model that learns the chain prefers the chosen answer, so DPO's loss falls
from log 2 when a step updates the right thing and stays there when it updates nothing: the
learning check can tell.

A GRPO step (`PromptStep`) holds `prompts` prompts of the chain (W11: 8 of ~64 tokens); the group
size and completion length are the workload's (`extra`), sampled by each implementation itself.

Everything is a function of (workload, step seed): any implementation rebuilds the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.batches import BASE_SEED, CHAIN_SEED, chain

SIGMA = 0.5  # of the log-normal lengths: spread without many extremes
METHOD_KINDS = ("dpo", "grpo")  # Workload.kind of the training-method workloads


@dataclass
class PairStep:
    seed: int
    pairs: list[tuple[list[int], list[int], list[int]]]  # (prompt, chosen, rejected) token ids

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    @property
    def num_tokens(self) -> int:
        """Tokens the step's sequences hold: each pair's prompt twice (once per answer)."""
        return sum(2 * len(p) + len(c) + len(r) for p, c, r in self.pairs)


@dataclass
class PromptStep:
    seed: int
    prompts: list[list[int]]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.prompts))


def _length(rng, mean: float, low: int, high: int) -> int:
    # A log-normal with this mean: mu = log(mean) - sigma^2 / 2.
    return int(np.clip(np.rint(rng.lognormal(np.log(mean) - SIGMA**2 / 2, SIGMA)), low, high))


def make_pair_step(seed: int, vocab: int, pairs: int, prompt_mean: float, answer_mean: float, max_tokens: int):
    c = chain(vocab)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(pairs):
        p = _length(rng, prompt_mean, 8, max_tokens // 2)
        a, b = (_length(rng, answer_mean, 8, max_tokens - p) for _ in range(2))
        run = c.sample(p + a, rng).tolist()
        rejected = rng.choice(c.symbols, size=b).tolist()
        out.append((run[:p], run[p:], rejected))
    return PairStep(seed, out)


def make_prompt_step(seed: int, vocab: int, prompts: int, prompt_mean: float, max_tokens: int):
    c = chain(vocab)
    rng = np.random.default_rng(seed)
    return PromptStep(seed, [c.sample(_length(rng, prompt_mean, 4, max_tokens), rng).tolist() for _ in range(prompts)])


def make_method_batches(wl, n: int, base_seed: int = BASE_SEED) -> list:
    """`n` steps of a DPO (kind "dpo") or GRPO (kind "grpo") workload."""
    x, vocab = wl.extra, wl.config["vocab_size"]
    if wl.kind == "dpo":
        return [
            make_pair_step(base_seed + i, vocab, x["pairs"], x["prompt_mean"], x["answer_mean"], x["max_tokens"])
            for i in range(n)
        ]
    if wl.kind == "grpo":
        return [
            make_prompt_step(base_seed + i, vocab, x["prompts"], x["prompt_mean"], x["max_tokens"]) for i in range(n)
        ]
    raise ValueError(f"{wl.id} is not a training-method workload (kind {wl.kind!r})")


def describe(wl) -> dict:
    """The record's note on a method workload's data, enough to rebuild it."""
    keys = ("pairs", "prompts", "prompt_mean", "answer_mean", "max_tokens", "group", "max_new_tokens", "beta")
    return {
        "ids": "markov" + (": chosen continues the chain, rejected uniform over its ids" if wl.kind == "dpo" else ""),
        "chain_seed": CHAIN_SEED,
        "base_seed": BASE_SEED,
        "length_sigma": SIGMA,
        **{k: wl.extra[k] for k in keys if k in wl.extra},
    }


def method_rates(wl, rec: dict) -> dict:
    """A method record's own figure from its median step time: pairs/s (DPO), completions/s
    (GRPO: prompts x group, generation and update together)."""
    step_s = rec.get("step_s")
    if rec.get("status") != "ok" or not step_s:
        return {}
    if wl.kind == "dpo":
        return {"pairs_per_step": wl.extra["pairs"], "pairs_per_s": wl.extra["pairs"] / step_s}
    n = wl.extra["prompts"] * wl.extra["group"]
    return {"completions_per_step": n, "completions_per_s": n / step_s}
