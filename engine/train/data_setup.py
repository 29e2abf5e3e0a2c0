"""The session's data step: the tokenizer, the objective's data and held-out examples, and what
the person is told about them (rows skipped, truncations, the held-out split, the packing).

`load_data` fails on bad data before the run folder exists; `data_notes` are logged once the
folder and its log are open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine.config import RunConfig
from engine.data import plural, shown_row

# How many skipped rows are named one by one; the rest are counted.
SKIPPED_SHOWN = 20


@dataclass
class LoadedData:
    tokenizer: Any
    data: Any  # the objective's prepared data (its packing, spec, notes, skipped rows)
    heldout: Optional[Any]  # the held-out examples, or None
    heldout_note: str  # how the held-out split was made ("" for none to tell)
    summary: dict  # data.summary() with eval_examples: what RunStarted carries


def load_data(config: RunConfig, objective, log: Callable[..., None]) -> LoadedData:
    """Tokenizer, the objective's data and its held-out examples."""
    from engine.models.loading import load_tokenizer

    log(f"Loading tokenizer and data ({config.data.source})")
    tokenizer = load_tokenizer(config.model)
    data = objective.prepare_data(tokenizer)
    record_thinking(config, getattr(data, "thinking", None))
    data, heldout, heldout_note = objective.held_out(data, tokenizer)
    summary = data.summary()
    summary["eval_examples"] = len(heldout) if heldout is not None else 0
    return LoadedData(tokenizer, data, heldout, heldout_note, summary)


def record_thinking(config: RunConfig, thinking) -> None:
    """data.thinking "auto" as the data resolved it (true: an answer carries its reasoning in a field),
    written into the config like a hardware choice, so the held-out file renders alike and the saved
    config.yaml tells the chat and the exports which switch the model was trained with."""
    if config.data.thinking == "auto" and thinking is not None:
        config.data.thinking = bool(thinking)
        if "data.thinking" not in config.auto_fields:
            config.auto_fields.append("data.thinking")
        config.auto_reasons["data.thinking"] = "an answer of the data carries its reasoning in a field"


def data_notes(loaded: LoadedData, max_seq_len: int) -> list[tuple[str, str]]:
    """(message, level) for each thing to say about the data, in the order the log says them."""
    data, summary = loaded.data, loaded.summary
    notes = []
    if loaded.heldout_note:
        notes.append((loaded.heldout_note, "info"))
    if data.used_fallback_template:
        notes.append(("The tokenizer has no chat template; using a plain ChatML template", "warning"))
    notes += [(note, "warning") for note in data.notes]
    if getattr(data, "thinking_said", ""):
        notes.append((data.thinking_said, "info"))
    for idx, reason in data.skipped[:SKIPPED_SHOWN]:
        notes.append((f"Row {shown_row(idx)} skipped: {reason}", "warning"))
    if len(data.skipped) > SKIPPED_SHOWN:
        more = plural(len(data.skipped) - SKIPPED_SHOWN, "more row", "more rows")
        notes.append((f"... and {more} skipped", "warning"))
    if data.truncated:
        was = "was" if data.truncated == 1 else "were"
        notes.append(
            (
                f"{plural(data.truncated, 'example')} {was} longer than {max_seq_len} tokens and {was} truncated",
                "warning",
            )
        )
    notes.append(
        (
            f"{plural(summary['examples'], 'example')} packed into {plural(summary['packed_rows'], 'row')} of "
            f"{summary['row_tokens']} tokens ({summary['packing_efficiency']:.1%} full)",
            "info",
        )
    )
    return notes
