"""Supervised fine-tuning: the next-token loss over each example's trained tokens.

The first objective, and the one every run used before there were others: the examples are
rendered conversations (or plain text) with their trained-token masks, packed best-fit into
rows; a forward's loss is the fused cross-entropy summed over trained targets and divided by
the trained tokens of the whole optimizer step.
"""

from __future__ import annotations

from engine.train.objectives import register
from engine.train.objectives.base import LossOutput, Objective


@register
class SFT(Objective):
    name = "sft"

    def prepare_data(self, tokenizer):
        from engine.data.dataset import prepare_dataset

        return prepare_dataset(self.config.data, tokenizer)

    def held_out(self, data, tokenizer):
        from engine.train import evaluation

        d = self.config.data
        if d.eval_source.strip():
            held, note = evaluation.load_heldout(d, d.eval_source, tokenizer)
            return data, held, note
        return evaluation.split_heldout(data, d.eval_fraction, self.config.training.seed)

    def collate(self, data, example_ids: list[int]):
        from engine.data.collate import PackedBatch

        return PackedBatch.from_documents([data.docs[d] for d in example_ids], [data.trained[d] for d in example_ids])

    def loss(self, forward, model, batch, normalizer) -> LossOutput:
        return LossOutput(forward.cross_entropy(model, batch, normalizer))

    def eval_batches(self, held_out, row_tokens: int, rows_per_batch: int) -> list:
        from engine.train.evaluation import eval_batches

        return eval_batches(held_out, row_tokens, rows_per_batch)
