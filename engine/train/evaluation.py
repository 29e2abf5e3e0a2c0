"""Running the model between optimizer steps without changing what the run trains: the held-out
split and its eval loss, the prompt gallery, and the live probe of a paused run.

Everything here must leave a run exactly where it was, so that a resumed or uninterrupted run
computes the same losses with or without it: `side_effect_free` saves and restores the RNG
states, switches the model to eval mode under `torch.no_grad()` and back to train mode, and
clears the fast-path counters (the next step's StepMetrics counts its own calls only). The
data position is not touched (the held-out examples are packed here, apart from the step
plan), and no adapter weight is written, so the fused LoRA path's cached adapter copies
(keyed on the optimizer-step generation) stay valid.

The split is drawn with its own `random.Random(seed)`, never the global generators, so it is
the same on a resume and on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

# The default held-out split: only for data sets with at least this many examples (a smaller
# one has none to spare), and never more than this many examples (an eval should cost a few
# steps' time, not an epoch's).
EVAL_MIN_EXAMPLES = 200
EVAL_MAX_EXAMPLES = 200
# training.eval_every "auto" spaces the evals so that all of them together cost at most this
# share of the training compute (an eval token's forward costs about a third of a trained
# token's forward + backward).
EVAL_SHARE = 0.10
# New tokens a gallery answer (and, by default, a probe reply) may have.
GALLERY_NEW_TOKENS = 64
# A held-out example of plain text has no prompt part: its first tokens (at most this many)
# are the prompt the model continues.
TEXT_PROMPT_TOKENS = 32


@dataclass
class HeldOut:
    """The examples the eval loss is measured on: token ids and trained masks, as training's."""

    docs: list[list[int]]
    trained: list[list[bool]]
    source: str  # "split" (of data.source) or the data.eval_source path

    def __len__(self) -> int:
        return len(self.docs)

    def prompt_ids(self, n: int) -> list[list[int]]:
        """The prompts of the first `n` held-out examples (the gallery's default prompts)."""
        return [prompt_ids_of(d, t) for d, t in zip(self.docs[:n], self.trained[:n])]


def draw_heldout(n: int, fraction: float, seed: int, what: str = "the eval loss") -> tuple[list[int], str]:
    """The held-out split's rule, for every method: (the indices held out, sorted, or [] for none;
    one sentence for the log). At least EVAL_MIN_EXAMPLES examples, `fraction` of them, at most
    EVAL_MAX_EXAMPLES, drawn with `seed`."""
    from engine.data import plural

    if fraction <= 0:
        return [], ""
    if n < EVAL_MIN_EXAMPLES:
        return [], (
            f"No held-out split: {plural(n, 'example')} (it takes {EVAL_MIN_EXAMPLES} or more; "
            "data.eval_source can name a separate file)"
        )
    k = max(1, min(EVAL_MAX_EXAMPLES, round(n * fraction)))
    held = sorted(random.Random(seed).sample(range(n), k))
    note = f"Held out {plural(k, 'example')} of {n} for {what} ({k / n:.1%}, drawn with seed {seed}; never trained on)"
    return held, note


def split_heldout(data, fraction: float, seed: int):
    """(training data, HeldOut or None, one sentence for the log). The held-out examples
    (`draw_heldout`) are removed from the training data, which is packed again."""
    from engine.data.packing import pack_best_fit_decreasing

    n = len(data.docs)
    held, note = draw_heldout(n, fraction, seed)
    if not held:
        return data, None, note
    chosen = set(held)
    keep = [i for i in range(n) if i not in chosen]
    docs = [data.docs[i] for i in keep]
    trained = [data.trained[i] for i in keep]
    packing = pack_best_fit_decreasing([len(d) for d in docs], data.packing.row_tokens)
    train = dataclasses.replace(data, docs=docs, trained=trained, packing=packing)
    heldout = HeldOut([data.docs[i] for i in held], [data.trained[i] for i in held], "split")
    return train, heldout, note


def load_heldout(data_config, source: str, tokenizer):
    """(HeldOut, one sentence) of a separate file read like the training data (its first
    EVAL_MAX_EXAMPLES usable examples)."""
    from engine.data import plural
    from engine.data.dataset import prepare_dataset

    cfg = dataclasses.replace(data_config, source=source, max_examples=0)
    prepared = prepare_dataset(cfg, tokenizer)
    docs, trained = prepared.docs[:EVAL_MAX_EXAMPLES], prepared.trained[:EVAL_MAX_EXAMPLES]
    capped = f" (the first {EVAL_MAX_EXAMPLES} of {len(prepared.docs)})" if len(prepared.docs) > len(docs) else ""
    return HeldOut(docs, trained, source), f"Eval loss on {plural(len(docs), 'example')} of {source}{capped}"


def auto_eval_every(total_steps: int, heldout_tokens: int, step_tokens: float) -> int:
    """Steps between evals for training.eval_every "auto": about 10 a run, fewer when the
    held-out set is large against a step (a short run on a big data set), so the evals never
    cost more than EVAL_SHARE of the training. The run's last step always has one."""
    every = max(1, round(total_steps / 10))
    if step_tokens > 0:
        every = max(every, math.ceil(heldout_tokens / (3 * EVAL_SHARE * step_tokens)))
    return min(every, max(1, total_steps))


def eval_batches(held: HeldOut, row_tokens: int, rows_per_batch: int) -> list:
    """The held-out examples packed into rows as training packs them, `rows_per_batch` rows per
    forward; [(PackedBatch)] on the host, built once per run."""
    from engine.data.collate import PackedBatch
    from engine.data.packing import pack_best_fit_decreasing

    packing = pack_best_fit_decreasing([len(d) for d in held.docs], row_tokens)
    rows = packing.rows
    out = []
    for i in range(0, len(rows), max(1, rows_per_batch)):
        ids = [d for r in rows[i : i + rows_per_batch] for d in r]
        out.append(PackedBatch.from_documents([held.docs[d] for d in ids], [held.trained[d] for d in ids]))
    return out


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def side_effect_free(model, device=None):
    """Run the model for evaluation or generation and leave the run as it was: RNG states
    restored, train mode back, no autograd graph, the counters of these forwards dropped.
    `device`: a CUDA device to make current (a probe runs on a thread of its own)."""
    import torch

    from engine.counters import reset_counters

    was_training = model.training
    state = rng_state()
    device_cm = torch.cuda.device(device) if device is not None and device.type == "cuda" else _nothing()
    try:
        with device_cm, torch.no_grad():
            model.eval()
            yield
    finally:
        if was_training:
            model.train()
        set_rng_state(state)
        reset_counters()


@contextmanager
def _nothing():
    yield


def prompt_ids_of(doc: list[int], trained: list[bool]) -> list[int]:
    """The prompt part of an example: its tokens up to the first trained one (the rendered
    conversation up to the assistant's turn), or the first tokens of a plain text."""
    first = next((i for i, t in enumerate(trained) if t), len(doc))
    if first >= 2:
        return list(doc[:first])
    return list(doc[: max(1, min(TEXT_PROMPT_TOKENS, len(doc) // 2))])


def encode_prompt(tokenizer, text: str, chat: bool, thinking=None) -> list[int]:
    """A typed prompt as the model sees it: a user turn through the chat template with the
    assistant's turn opened (as the Chat page does, with the run's data.thinking), or plain text
    for a text-format run."""
    if chat:
        from engine.data.render import ensure_chat_template, thinking_vars

        ensure_chat_template(tokenizer)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            **thinking_vars(tokenizer, thinking),
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def stop_token_ids(tokenizer) -> set[int]:
    """The tokens that end an answer: EOS and the common end-of-turn tokens the vocabulary has."""
    stops = set()
    eos = tokenizer.eos_token_id
    for e in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(e, int):
            stops.add(e)
    unk = tokenizer.unk_token_id
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            stops.add(tid)
    return stops


def greedy_answers(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: set[int],
    device,
    max_len: int,
    agree: Optional[Callable[[list[int]], list[int]]] = None,
) -> list[list[int]]:
    """The greedy continuations of `prompts` (each at most `max_new_tokens`, ending before a
    stop token), through the same packed forward as training. Call it inside side_effect_free.

    The prompts still answering go in one packed batch per new token (the packed attention
    keeps each one to itself), so a gallery of N prompts costs as many forwards as one. No KV
    cache: each token runs the whole sequences again, which costs more compute but keeps the
    packed attention path the run trains with (it has no cache), so the answer is what the
    trained weights say on the run's own code path.

    `agree`: every process of a sharded (FSDP) run generates together, one forward each per
    token; agree(tokens) is rank 0's tokens on every rank, so all take the same steps."""
    import itertools

    import torch

    from engine.data.collate import PackedBatch
    from engine.train.step import decoder_hidden

    keep = max(1, max_len - max_new_tokens)
    seqs = [list(p)[-keep:] for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live:
            break
        batch = PackedBatch.from_documents([seqs[i] for i in live]).to(device)
        # The training forward's own path: a family that runs each document alone does so here too.
        _, hidden, head = decoder_hidden(model, batch)
        ends = [n - 1 for n in itertools.accumulate(len(seqs[i]) for i in live)]
        tokens = head(hidden[torch.tensor(ends, device=hidden.device)]).argmax(-1).tolist()
        if agree is not None:
            tokens = agree(tokens)
        batch.info.free()
        still = []
        for i, token in zip(live, tokens):
            if token in stops:
                continue
            seqs[i].append(token)
            outs[i].append(token)
            still.append(i)
        live = still
    return outs


def best_improved(loss: float, best: Optional[float]) -> bool:
    """A new best eval loss: lower than the best so far by more than rounding."""
    import math

    if not math.isfinite(loss):
        return False
    return best is None or loss < best - 1e-9 * max(1.0, abs(best))
