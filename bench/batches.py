"""The benchmark's batches: the same packed rows for every implementation, and learnable.

One step is `tokens` tokens in one row. Packed workloads draw document lengths from
LogNormal(mu=5.3, sigma=0.7) clipped to [16, 2048], the last one trimmed to fill the row
exactly ("single" workloads: one document of `tokens`). Step i uses the seed BASE_SEED + i.

Token ids follow a Markov chain (engine.data.synthetic, WORKLOADS.md "The common recipe"): a
fixed set of 256 ids drawn from the vocabulary and a fixed cycle over them; with probability
0.7 the next id is the current one's successor in the cycle, otherwise a uniformly drawn id
of the set; each document starts at a uniformly drawn id of the set. The chain (which ids,
which cycle) is fixed per workload by CHAIN_SEED and the vocabulary size; the draws of a step
by its seed. Uniform random ids, the first recipe, cannot be learned: a training step that
updates nothing then looks exactly like one that works, which hid a broken fast path for
weeks. On this data the loss falls from about log(vocab) towards the chain's entropy
(`entropy_floor`, about 2.3 nats), so a broken step shows as a flat loss curve.

Everything is a function of (seed, tokens, vocab, packing, CHAIN_SEED): any process (the
Unsloth child included) rebuilds identical batches from the same numbers; `describe()` is
what a record stores about its data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.data.synthetic import P_NEXT, SET_SIZE, MarkovChain, token_documents

MU, SIGMA, MIN_LEN, MAX_LEN = 5.3, 0.7, 16, 2048
BASE_SEED = 20_261_129
CHAIN_SEED = 20_261_130  # fixed: every step and every process of a workload sees one chain
DATA = "markov"  # what records say about their token ids (records without it: uniform ids)


@dataclass
class StepBatch:
    seed: int
    lengths: list[int]
    ids: torch.Tensor  # int64 [T] on the host

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def documents(self) -> list[list[int]]:
        flat = self.ids.tolist()
        out, start = [], 0
        for n in self.lengths:
            out.append(flat[start : start + n])
            start += n
        return out

    def starts(self) -> torch.Tensor:
        cu = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        return torch.from_numpy(cu.astype(np.int64))

    def position_ids(self) -> torch.Tensor:
        lens = torch.tensor(self.lengths, dtype=torch.int64)
        starts = torch.repeat_interleave(self.starts(), lens)
        return torch.arange(self.num_tokens, dtype=torch.int64) - starts

    def hf_inputs(self) -> dict[str, torch.Tensor]:
        """Inputs for a stock transformers causal LM: packing is read from position_ids.

        HF shifts labels left by one inside its loss, so -100 at each document start keeps a
        document's last token from being trained on the next document's first token: the
        trained targets are exactly the engine's (every next token within a document).
        """
        labels = self.ids.clone()
        labels[self.starts()] = -100
        return {
            "input_ids": self.ids.unsqueeze(0),
            "position_ids": self.position_ids().unsqueeze(0),
            "labels": labels.unsqueeze(0),
        }

    @property
    def num_trained_tokens(self) -> int:
        return self.num_tokens - len(self.lengths)


def doc_lengths(seed: int, total: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    filled = 0
    while filled < total:
        draw = rng.lognormal(MU, SIGMA, size=64)
        for n in np.clip(np.rint(draw), MIN_LEN, MAX_LEN).astype(int).tolist():
            n = min(n, total - filled)  # the last document is trimmed to fill the row exactly
            lengths.append(n)
            filled += n
            if filled == total:
                break
    return lengths


def make_step(seed: int, total: int, vocab: int, packing: str = "packed") -> StepBatch:
    lengths = doc_lengths(seed, total) if packing == "packed" else [total]
    docs = token_documents(vocab, lengths, seed, chain_seed=CHAIN_SEED)
    ids = torch.from_numpy(np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]))
    return StepBatch(seed, lengths, ids)


def chain(vocab: int) -> MarkovChain:
    """The workload's chain (the one `make_step` draws from)."""
    return MarkovChain.over_vocab(vocab, CHAIN_SEED)


def entropy_floor(vocab: int) -> float:
    """Nats per token of a model that knows the chain: where a loss curve can fall to."""
    return chain(vocab).entropy_floor()


def describe(vocab: int, base_seed: int = BASE_SEED) -> dict:
    """The record's note on its batches, enough to rebuild them."""
    return {
        "ids": DATA,
        "chain_seed": CHAIN_SEED,
        "base_seed": base_seed,
        "set_size": min(SET_SIZE, vocab),
        "p_next": P_NEXT,
        "entropy_floor": round(entropy_floor(vocab), 4),
    }


def make_batches(
    n: int, total: int, vocab: int, packing: str = "packed", base_seed: int = BASE_SEED
) -> list[StepBatch]:
    return [make_step(base_seed + i, total, vocab, packing) for i in range(n)]
