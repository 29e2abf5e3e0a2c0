"""The benchmark's batches: the same packed rows for every implementation.

One step is `tokens` tokens in one row. Packed workloads draw document lengths from
LogNormal(mu=5.3, sigma=0.7) clipped to [16, 2048], the last one trimmed to fill the row
exactly; token ids are uniform over the vocabulary; a fresh seed per step (base + index), so
any process (the Unsloth child included) rebuilds identical batches from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MU, SIGMA, MIN_LEN, MAX_LEN = 5.3, 0.7, 16, 2048
BASE_SEED = 20_261_129


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
            out.append(flat[start:start + n])
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
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (total,), generator=g, dtype=torch.int64)
    return StepBatch(seed, lengths, ids)


def make_batches(n: int, total: int, vocab: int, packing: str = "packed", base_seed: int = BASE_SEED) -> list[StepBatch]:
    return [make_step(base_seed + i, total, vocab, packing) for i in range(n)]
