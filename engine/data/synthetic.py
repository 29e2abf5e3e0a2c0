"""Learnable synthetic data: token ids and text documents whose next item can be predicted.

A training step that updates nothing looks exactly like one that works when the data cannot
be learned (uniform random tokens): the loss stays at log(vocab) either way. These generators
give a LoRA something to learn, so a broken fast path shows as a flat loss curve:

- a fixed set of `set_size` symbols (token ids drawn from the vocabulary, or words);
- a fixed cycle over that set: with probability `p_next` the next symbol is the current one's
  successor in the cycle, otherwise a symbol of the set drawn uniformly.

Everything is a function of the seed, so every process (the benchmark's peers, a test's two
runs) rebuilds identical data. Used by the benchmark's batches, the learning-parity tests and
`python -m engine.data.synthetic` (a JSONL file for `tunesmith train`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.data import plural

P_NEXT = 0.7
SET_SIZE = 256


@dataclass(frozen=True)
class MarkovChain:
    """The fixed symbol set and its cycle: `symbols[i]` is followed by `symbols[succ[i]]`."""

    symbols: np.ndarray  # [set_size] int64 (token ids) or indices into a word list
    succ: np.ndarray  # [set_size] int64, a single cycle over range(set_size)
    p_next: float = P_NEXT

    @classmethod
    def over_vocab(
        cls, vocab_size: int, seed: int, set_size: int = SET_SIZE, p_next: float = P_NEXT, low: int = 0
    ) -> "MarkovChain":
        """A chain over `set_size` distinct token ids drawn from [low, vocab_size)."""
        rng = np.random.default_rng(seed)
        n = min(set_size, vocab_size - low)
        symbols = rng.choice(np.arange(low, vocab_size, dtype=np.int64), size=n, replace=False)
        order = rng.permutation(n)
        succ = np.empty(n, dtype=np.int64)
        succ[order] = np.roll(order, -1)  # order[k] -> order[k+1]: one cycle through the set
        return cls(symbols, succ, p_next)

    def sample(self, length: int, rng: np.random.Generator) -> np.ndarray:
        """`length` symbols of the chain (int64), starting from a uniformly drawn one."""
        n = len(self.symbols)
        idx = np.empty(length, dtype=np.int64)
        if length == 0:
            return idx
        follow = rng.random(length) < self.p_next
        jumps = rng.integers(0, n, size=length)
        idx[0] = jumps[0]
        for i in range(1, length):  # a loop over ints: a 16k-token step takes a few ms
            idx[i] = self.succ[idx[i - 1]] if follow[i] else jumps[i]
        return self.symbols[idx]

    def entropy_floor(self) -> float:
        """The loss (nats per token) of a model that knows the chain: the best any run can reach."""
        n = len(self.symbols)
        p_succ = self.p_next + (1 - self.p_next) / n
        p_other = (1 - self.p_next) / n
        return float(-(p_succ * np.log(p_succ) + (n - 1) * p_other * np.log(p_other)))


def token_documents(vocab_size: int, lengths, seed: int, chain_seed: int = 0, low: int = 0) -> list[list[int]]:
    """One document of token ids per length; the chain is fixed by `chain_seed`, the draws by `seed`."""
    chain = MarkovChain.over_vocab(vocab_size, chain_seed, low=low)
    rng = np.random.default_rng(seed)
    return [chain.sample(int(n), rng).tolist() for n in lengths]


# Words for text documents: distinct lower-case syllable pairs, so a byte-level or word-piece
# tokenizer splits each into a few stable pieces.
_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


def _words(count: int) -> list[str]:
    syllables = [o + v for o in _ONSETS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables if a != b]
    order = np.random.default_rng(1234).permutation(len(words))  # spread over the syllables
    return [words[i] for i in order[:count]]


def text_documents(
    n_docs: int, seed: int, words_per_doc: tuple[int, int] = (40, 120), set_size: int = 64, chain_seed: int = 0
) -> list[str]:
    """`n_docs` plain-text documents of space-separated words following the chain."""
    vocab = _words(set_size)
    chain = MarkovChain.over_vocab(len(vocab), chain_seed, set_size=set_size)
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(words_per_doc[0], words_per_doc[1] + 1))
        docs.append(" ".join(vocab[i] for i in chain.sample(n, rng)))
    return docs


def write_text_jsonl(path: str | Path, n_docs: int, seed: int = 0, **kwargs) -> Path:
    """A JSONL file of {"text": document} rows (data.format "text")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in text_documents(n_docs, seed, **kwargs):
            f.write(json.dumps({"text": doc}) + "\n")
    tmp.replace(path)
    return path


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m engine.data.synthetic", description="Write a JSONL file of learnable plain-text documents."
    )
    p.add_argument("out", help="the .jsonl file to write")
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-words", type=int, default=40)
    p.add_argument("--max-words", type=int, default=120)
    a = p.parse_args(argv)
    path = write_text_jsonl(a.out, a.docs, a.seed, words_per_doc=(a.min_words, a.max_words))
    print(f"wrote {plural(a.docs, 'document')} to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
