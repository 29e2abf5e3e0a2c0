"""From a DataConfig and a tokenizer to packed, trainable documents.

`prepare_dataset` reads the rows, detects the format, renders and tokenizes every example
with its trained-token mask, truncates or drops examples longer than a row (and counts
them), skips unusable rows with the reason (a row the chat template rejects is one of them:
one row, one error, never the run), and packs the rest best-fit-decreasing. `notes` says once
what applies to many rows (a template that drops earlier answers' reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import DataConfig
from engine.data import plural, shown_row
from engine.data.formats import FormatSpec, data_thinking, detect_format, row_to_messages
from engine.data.packing import PackingResult, pack_best_fit_decreasing
from engine.data.render import ensure_chat_template, thinking_vars, tokenize_rows
from engine.data.sources import DataError, load_raw


@dataclass
class PreparedData:
    docs: list[list[int]]
    trained: list[list[bool]]
    packing: PackingResult
    spec: FormatSpec
    num_rows: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row index, reason)
    truncated: int = 0
    dropped_overlong: int = 0
    used_fallback_template: bool = False
    notes: list[str] = field(default_factory=list)  # one sentence each, said once for the whole set
    # The thinking switch the template was given (data.thinking resolved; None: the template's default).
    thinking: bool | None = None
    thinking_said: str = ""  # thinking_note: which of the template's variables it was, for the log

    def summary(self) -> dict:
        lengths = [len(d) for d in self.docs]
        longest = max(lengths) if lengths else 0
        return {
            "rows_read": self.num_rows,
            "examples": len(self.docs),
            "skipped": len(self.skipped),
            "truncated": self.truncated,
            "dropped_overlong": self.dropped_overlong,
            "format": self.spec.describe(),
            "packed_rows": len(self.packing.rows),
            "row_tokens": self.packing.row_tokens,
            "tokens": self.packing.total_tokens,
            "trained_tokens": sum(sum(t) for t in self.trained),
            "packing_efficiency": round(self.packing.efficiency, 4),
            "padding_avoided_tokens": self.packing.padding_avoided(len(self.docs), longest),
        }


def reasoning_note(rows: int, choice: str) -> str:
    """The one sentence about rows whose template drops earlier answers' reasoning."""
    what = {
        "drop": "those answers are trained as rendered, without their reasoning",
        "final_turn_only": "only the last answer of each conversation is trained",
        "keep": "each answer is trained as the last turn of its own example, with its reasoning",
    }[choice]
    return (
        f"The chat template drops the <think> reasoning of earlier answers in {plural(rows, 'row')}; "
        f"{what} (data.earlier_reasoning: drop | final_turn_only | keep)"
    )


def untrained_reason(trained: list[bool], limit: int) -> str:
    """Why an example trains nothing: no answer, or (a template with a long preamble: Command-R7B's
    default system turn is hundreds of tokens) the cut at max_seq_len removed every answer token."""
    if any(trained[1:]):
        return (
            f"the cut at data.max_seq_len ({limit} tokens) removed every answer token "
            "(the prompt is longer; raise data.max_seq_len)"
        )
    return "no trained tokens (nothing to learn from this row)"


def no_usable_rows(cfg: DataConfig, rows: int, skipped: list[tuple[int, str]]) -> DataError:
    """Why a run cannot start: every row was unusable; the first reason, and how many share it."""
    if not skipped:
        return DataError(f"{cfg.source}: no usable examples out of {plural(rows, 'row')}")
    first = skipped[0][1]
    same = sum(reason == first for _, reason in skipped)
    share = "every row" if same == len(skipped) == rows else f"{plural(same, 'row')}"
    return DataError(
        f"{cfg.source}: no usable examples out of {plural(rows, 'row')}, so the run cannot start; "
        f"{share} failed with: {first} (first: row {shown_row(skipped[0][0])})"
    )


def thinking_note(tokenizer, thinking: bool | None) -> str:
    """The one sentence saying which thinking switch the template was given, or "" (none it reads)."""
    names = list(thinking_vars(tokenizer, thinking))
    if not names:
        return ""
    said = " and ".join(f"{n}={'true' if thinking else 'false'}" for n in names)
    return f"The chat template renders with {said} (data.thinking), in training, eval and the chat"


def _row_batches(raw):
    """(index of the first row, [rows]) in batches: engine.data.scan.Rows' own (the packing view's,
    with its progress and stop check) or, for a plain data set, the same batches without them."""
    from engine.data.scan import Rows  # here: scan imports the modules that import this one

    return (raw if isinstance(raw, Rows) else Rows(raw)).batches()


def prepare_dataset(cfg: DataConfig, tokenizer, raw=None) -> PreparedData:
    raw = load_raw(cfg) if raw is None else raw
    spec = detect_format(list(raw.column_names), cfg.format, cfg.columns, cfg.source)
    fallback = ensure_chat_template(tokenizer) if spec.kind != "text" else False
    thinking = data_thinking(cfg.thinking, raw, spec)
    docs, masks, skipped = [], [], []
    truncated = dropped = dropped_reasoning = 0
    limit = cfg.max_seq_len
    for start, batch in _row_batches(raw):
        # A batch's rows rendered and tokenized together (as the X-ray does): one fast-tokenizer
        # call for the batch instead of one per row.
        examples: list = []  # each row's messages or text, or the ValueError that says why not
        for row in batch:
            try:
                examples.append(row_to_messages(row, spec))
            except ValueError as exc:
                examples.append(exc)
        readable = [ex for ex in examples if not isinstance(ex, ValueError)]
        toks = iter(
            tokenize_rows(
                tokenizer,
                readable,
                cfg.train_on_responses_only,
                cfg.fold_system_message,
                cfg.earlier_reasoning,
                thinking,
            )
        )
        for i, example in enumerate(examples, start):
            got = example if isinstance(example, ValueError) else next(toks)
            if isinstance(got, ValueError):  # unreadable, or render.RowError (the template rejects the row)
                skipped.append((i, str(got)))
                continue
            dropped_reasoning += any(a.reasoning_dropped for t in got for a in t.answers)
            for tok in got:
                ids, trained = tok.ids, tok.trained
                if len(ids) > limit:
                    if cfg.overlong == "drop":
                        dropped += 1
                        skipped.append((i, f"{len(ids)} tokens, longer than a row ({limit}); dropped"))
                        continue
                    ids, trained = ids[:limit], trained[:limit]
                    truncated += 1
                if sum(trained[1:]) == 0:
                    skipped.append((i, untrained_reason(tok.trained, limit)))
                    continue
                docs.append(ids)
                masks.append(trained)
    if not docs:
        raise no_usable_rows(cfg, len(raw), skipped)
    notes = [reasoning_note(dropped_reasoning, cfg.earlier_reasoning)] if dropped_reasoning else []
    packing = pack_best_fit_decreasing([len(d) for d in docs], limit)
    prepared = PreparedData(docs, masks, packing, spec, len(raw), skipped, truncated, dropped, fallback, notes)
    prepared.thinking, prepared.thinking_said = thinking, thinking_note(tokenizer, thinking)
    return prepared
