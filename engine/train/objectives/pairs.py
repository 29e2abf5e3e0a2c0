"""What DPO, ORPO and SimPO share as objectives: pairs read and packed, the pair batch, the
per-step reference pass, and per-pair metrics. Each method's module adds only its loss.

A pair is one example: its chosen and rejected completions are two documents of the same packed
row (`SequenceBatch`, chosen first), so a pair never straddles rows and the packed attention
needs no padding. The step's normalizer is its number of pairs: every forward divides its summed
per-pair losses by it, so gradient accumulation equals one large batch.

Held-out examples (`PairHeldOut`: a share split off with data.eval_fraction, as SFT's rule, or
data.eval_source read like the training file) give the eval: the method's own loss per example
and its metrics (DPO, ORPO, SimPO: reward margin and accuracy; KTO: its rewards and KL), and the
gallery's prompts (each example's prompt). The best checkpoint is the lowest held-out loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.train.objectives.base import Objective
from engine.train.objectives.logps import SequenceBatch, completion_sums, token_logps

AUTO_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1}


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


class PairObjective(Objective):
    """Paired preference data; `needs_reference` adds the reference pass in `prepare_step`."""

    needs_reference = False

    @property
    def beta(self) -> float:
        b = self.config.preference.beta
        return AUTO_BETA[self.name] if b == "auto" else float(b)

    def prepare_data(self, tokenizer):
        from engine.data.preference import prepare_preference_data

        return prepare_preference_data(self.config.data, tokenizer, self.data_kind)

    data_kind = "paired"  # engine.data.preference's kind of example

    def held_out(self, data, tokenizer):
        d = self.config.data
        if d.eval_source.strip():
            return data, *load_held_pairs(d, tokenizer, self.data_kind)
        return split_pairs(data, d.eval_fraction, self.config.training.seed)

    def collate(self, data, example_ids: list[int]):
        seqs = []
        for i in example_ids:
            p, c, r = data.examples[i]
            seqs += [(p, c), (p, r)]
        return SequenceBatch.from_sequences(seqs, score_prompt=self.name == "orpo")

    def normalizer(self, batches: list) -> int:
        return max(1, sum(b.num_docs // 2 for b in batches))

    def prepare_step(self, ctx, micro: list) -> list:
        if not self.needs_reference:
            return micro
        # The reference: the same weights with the adapters off, per step (see dpo.py for why).
        with ctx.adapters_off():
            for _, batch in micro:
                dev = batch.to(ctx.device)
                batch.extra["ref"] = completion_sums(token_logps(ctx.forward, ctx.model, dev), dev).detach()
                dev.info.free()
        return micro

    def prepare_eval(self, ctx, batches: list) -> None:
        # The held-out batches are the same at every eval and so is the reference (the base
        # with its adapters off): its log-probs are computed at the first eval and kept.
        todo = [(None, b) for b in batches if "ref" not in b.extra]
        if todo:
            self.prepare_step(ctx, todo)
        return batches

    def step_metrics(self, sums):
        return per_pair(sums)

    def eval_batches(self, held_out, row_tokens, rows_per_batch):
        from engine.data.packing import pack_best_fit_decreasing

        rows = pack_best_fit_decreasing([len(d) for d in held_out.docs], row_tokens).rows
        step = max(1, rows_per_batch)
        return [
            self.collate(held_out.data, [d for r in rows[i : i + step] for d in r]) for i in range(0, len(rows), step)
        ]


def chosen_rejected(values: torch.Tensor):
    """Per-document values of a pair batch -> (chosen, rejected)."""
    return values[0::2], values[1::2]


@dataclass
class PairHeldOut:
    """Held-out preference examples: a PreferenceData of the training data's kind (pairs, or
    KTO's labelled answers with their KL twins) and where they come from ("split" or a path).
    `docs` and `prompt_ids` are what the eval schedule and the gallery read."""

    data: object  # engine.data.preference.PreferenceData
    source: str

    @property
    def docs(self) -> list[list[int]]:
        return self.data.docs

    def __len__(self) -> int:
        return len(self.data.examples)

    def prompt_ids(self, n: int) -> list[list[int]]:
        """The prompts of the first `n` held-out examples, each once (the gallery's prompts)."""
        out: list[list[int]] = []
        for example in self.data.examples:
            if len(out) == n:
                break
            if list(example[0]) not in out:
                out.append(list(example[0]))
        return out


def _subset(data, keep: list[int]):
    """`data` (a PreferenceData) with only the examples `keep`, packed again (GRPO's prompts
    one to a row, as engine.data.preference packs them)."""
    from engine.data.packing import PackingResult, pack_best_fit_decreasing

    pick = lambda values: [values[i] for i in keep] if values else values  # noqa: E731
    docs = pick(data.docs)
    if data.kind == "prompts":
        packing = PackingResult([[i] for i in range(len(docs))], data.packing.row_tokens, sum(map(len, docs)))
    else:
        packing = pack_best_fit_decreasing([len(d) for d in docs], data.packing.row_tokens)
    return dataclasses.replace(
        data,
        examples=pick(data.examples),
        docs=docs,
        labels=pick(data.labels),
        rows=pick(data.rows),
        row_ids=pick(data.row_ids),
        packing=packing,
    )


def split_pairs(data, fraction: float, seed: int):
    """(training data, PairHeldOut or None, one sentence for the log): SFT's rule
    (engine.train.evaluation.draw_heldout); the held-out examples are removed from the training
    data, which is packed again."""
    from engine.train.evaluation import draw_heldout

    n = len(data.examples)
    held, note = draw_heldout(n, fraction, seed, what="the eval")
    if not held:
        return data, None, note
    taken = set(held)
    return _subset(data, [i for i in range(n) if i not in taken]), PairHeldOut(_subset(data, held), "split"), note


def load_held_pairs(data_config, tokenizer, kind: str, extra_tokens: int = 0):
    """(PairHeldOut, one sentence) of data.eval_source, read like the training file (its first
    EVAL_MAX_EXAMPLES usable examples)."""
    from engine.data import plural
    from engine.data.preference import prepare_preference_data
    from engine.train.evaluation import EVAL_MAX_EXAMPLES

    source = data_config.eval_source
    cfg = dataclasses.replace(data_config, source=source, max_examples=0)
    held = prepare_preference_data(cfg, tokenizer, kind, extra_tokens=extra_tokens)
    n = len(held.examples)
    if n > EVAL_MAX_EXAMPLES:
        held = _subset(held, list(range(EVAL_MAX_EXAMPLES)))
    capped = f" (the first {EVAL_MAX_EXAMPLES} of {n})" if n > EVAL_MAX_EXAMPLES else ""
    return PairHeldOut(held, source), f"Eval on {plural(len(held.examples), 'example')} of {source}{capped}"
