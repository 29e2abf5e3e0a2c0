"""Data inspection for the window, without training: raw rows, detected format, one rendered
example with its trained-token mask, and the packing layout.

Every function runs the same code the training run uses (sources, formats, render, packing),
so what the window shows is what will be trained. The tokenizer is the caller's (engine.api's
`load_tokenizer`): data preparation receives one and never loads a model. The raw data set is
memoized per source file version, because the window asks for rows, an example and the layout
one after another.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.config import DataConfig
from engine.data import plural, shown_row
from engine.data.formats import FormatSpec, UnmatchedColumns, data_thinking, detect_format, row_to_messages
from engine.data.render import ensure_chat_template, tokenize_example
from engine.data.sources import DataError, load_raw, resolve_source

_RAW_CACHE: dict[tuple, Any] = {}


def _raw(cfg: DataConfig):
    path, builder = resolve_source(cfg.source)
    stamp = os.stat(path).st_mtime_ns if builder is not None else None
    key = (path, cfg.subset, cfg.split, cfg.max_examples, stamp)
    if key not in _RAW_CACHE:
        _RAW_CACHE.clear()  # one data set at a time is what the window shows
        _RAW_CACHE[key] = load_raw(cfg)
    return _RAW_CACHE[key]


@dataclass
class DataPreview:
    columns: list[str]
    num_rows: int
    format: Optional[FormatSpec]
    mapping: dict[str, str]
    problems: list[tuple[int, str]] = field(default_factory=list)  # (row index, reason)
    error: Optional[str] = None  # the format could not be detected (rows still browsable)
    _dataset: Any = None
    # The DataError behind `error`: an UnmatchedColumns carries columns, kinds and hint fields the
    # window words its own way (the CLI prints str(error)).
    error_detail: Optional[DataError] = None
    # GRPO's prompts: the columns beside the prompt, which the reward functions read.
    extra_columns: list[str] = field(default_factory=list)
    # The chosen method cannot read these columns (its data kind is missing): one sentence, "" else.
    method_problem: str = ""

    def row(self, i: int) -> dict:
        return dict(self._dataset[i])


@dataclass
class RenderedExample:
    index: int
    pieces: list[tuple[str, bool]]  # (token text, trained)
    n_tokens: int
    n_trained: int
    truncated: bool
    fallback_template: bool
    # A preference row, side by side: "prompt", "chosen", "rejected" (paired) or "prompt",
    # "completion" (KTO), each the (token text, trained) pieces its document holds; None for SFT.
    sides: Optional[dict[str, list[tuple[str, bool]]]] = None
    label: Optional[bool] = None  # KTO: the answer is desirable
    columns: dict[str, Any] = field(default_factory=dict)  # GRPO: the row's columns the rewards read


@dataclass
class PackingLayout:
    rows: list[list[int]]  # document lengths per packed row
    row_tokens: int
    efficiency: float
    padding_avoided: int
    examples: int
    truncated: int
    dropped: int
    skipped: list[tuple[int, str]]


# What the window calls each preference data kind (engine.data.preference) as its format. Not
# GRPO's prompts: a lone prompt-like column is also an SFT file with its answer column unnamed,
# which must still open the column mapping (a GRPO file with an answer column reads as SFT data).
PREFERENCE_FORMATS = {"paired": "preference pairs", "unpaired": "labelled answers (KTO)"}
PROMPTS_FORMAT = "prompts (GRPO)"
# The data kind each training method reads (engine.data.preference); SFT's are the formats.
METHOD_DATA = {"dpo": "paired", "orpo": "paired", "simpo": "paired", "kto": "unpaired", "grpo": "prompts"}
METHOD_DATA_WORDS = {
    "paired": "prompt / chosen / rejected pairs",
    "unpaired": "prompt / completion / label rows",
    "prompts": "a prompt column",
}


def _method_spec(cfg: DataConfig, columns: list[str], method: str):
    """(the spec of the data kind `method` reads, or None; why not, or "")."""
    from engine.data.preference import detect_preference_format

    kind = METHOD_DATA.get(method)
    if kind is None or cfg.format != "auto":
        return None, ""
    try:
        return detect_preference_format(columns, kind, cfg.columns, cfg.source), ""
    except DataError as exc:
        return None, f"{method.upper()} reads {METHOD_DATA_WORDS[kind]}: {exc}"


def _preference_spec(cfg: DataConfig, columns: list[str], method: str = "sft"):
    """The preference data kind of columns no supervised format matches (pairs, KTO's labelled
    answers), or None. Supervised formats win: a file both could read trains SFT
    as before, and training.method decides what a run reads: the data kind of the chosen method
    (`method`, engine.train.objectives' names) comes first (KTO's prompt/completion/label would
    otherwise read as SFT's instruction/output, GRPO's prompt/answer likewise)."""
    from engine.data.preference import detect_preference_format

    spec, _ = _method_spec(cfg, columns, method)
    if spec is not None:
        return spec
    try:
        detect_format(columns, cfg.format, cfg.columns, cfg.source)
        return None
    except DataError:
        pass
    for kind in PREFERENCE_FORMATS:
        try:
            return detect_preference_format(columns, kind, cfg.columns, cfg.source)
        except DataError:
            continue
    return None


def load_preview(cfg: DataConfig, method: str = "sft") -> DataPreview:
    """Rows and detected format, for `method` (training.method: its data kind first);
    raises DataError when the file cannot be read at all."""
    ds = _raw(cfg)
    columns = list(ds.column_names)
    mine, method_problem = _method_spec(cfg, columns, method)
    if mine is not None:  # rows are checked by the X-ray and the packing (their skipped rows)
        name = PROMPTS_FORMAT if mine.kind == "prompts" else PREFERENCE_FORMATS[mine.kind]
        extra = [c for c in columns if c not in mine.mapping.values()] if mine.kind == "prompts" else []
        return DataPreview(
            columns,
            len(ds),
            FormatSpec(name, dict(mine.mapping)),
            dict(mine.mapping),
            [],
            None,
            ds,
            extra_columns=extra,
        )
    try:
        spec = detect_format(columns, cfg.format, cfg.columns, cfg.source)
    except DataError as exc:
        pref = _preference_spec(cfg, columns)
        if pref is not None:
            spec = FormatSpec(PREFERENCE_FORMATS[pref.kind], dict(pref.mapping))
            if not method_problem and METHOD_DATA.get(method) is None:
                # SFT chosen with a file only the preference methods read: say so before Train.
                method_problem = _needs_a_preference_method(pref.kind)
            return DataPreview(columns, len(ds), spec, dict(pref.mapping), [], None, ds, method_problem=method_problem)
        if isinstance(exc, UnmatchedColumns) and not exc.hint and _prompts_only(cfg, columns):
            exc.hint = PROMPTS_ONLY
            exc.args = (exc.cli_message(),)  # its sentence says it too
        return DataPreview(columns, len(ds), None, {}, [], str(exc), ds, exc, method_problem=method_problem)
    problems = []
    for i, row in enumerate(ds):
        try:
            row_to_messages(row, spec)
        except ValueError as exc:
            problems.append((i, str(exc)))
    return DataPreview(columns, len(ds), spec, dict(spec.mapping), problems, None, ds, method_problem=method_problem)


# Why SFT cannot train a prompts file (the window's Data page and Train button say it).
PROMPTS_ONLY = (
    "these are prompts without answers, GRPO's data: SFT learns from answers, so pick GRPO on the Train page "
    "(it samples answers and scores them with reward functions) or map an answer column"
)


def _needs_a_preference_method(kind: str) -> str:
    """Why SFT cannot train a file of preference data `kind` (paired or unpaired), and what does."""
    names = [{"simpo": "SimPO"}.get(m, m.upper()) for m, k in METHOD_DATA.items() if k == kind]
    methods = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
    verb = "train" if len(names) > 1 else "trains"
    return (
        f"these are {PREFERENCE_FORMATS[kind]}, which {methods} {verb}: SFT learns from one answer per prompt, "
        f"so pick {methods} on the Train page or map SFT's columns"
    )


def _prompts_only(cfg: DataConfig, columns: list[str]) -> bool:
    from engine.data.preference import detect_preference_format

    try:
        detect_preference_format(columns, "prompts", None, cfg.source)
        return True
    except DataError:
        return False


def render_example(tokenizer, cfg: DataConfig, index: int, method: str = "sft") -> RenderedExample:
    ds = _raw(cfg)
    if not 0 <= index < len(ds):
        raise DataError(f"row {shown_row(index)} does not exist ({plural(len(ds), 'row')})")
    pref = _preference_spec(cfg, list(ds.column_names), method)
    if pref is not None:
        return _render_preference(tokenizer, cfg, ds, index, pref.kind)
    spec = detect_format(list(ds.column_names), cfg.format, cfg.columns, cfg.source)
    fallback = ensure_chat_template(tokenizer) if spec.kind != "text" else False
    try:
        example = row_to_messages(ds[index], spec)
    except ValueError as exc:
        raise DataError(f"row {shown_row(index)}: {exc}") from exc
    try:
        tok = tokenize_example(
            tokenizer,
            example,
            cfg.train_on_responses_only,
            cfg.fold_system_message,
            cfg.earlier_reasoning,
            _thinking(cfg, ds, spec),
        )
    except ValueError as exc:  # render.RowError: the template rejects the row (training drops it)
        raise DataError(f"row {shown_row(index)}: {exc}") from exc
    truncated = len(tok.ids) > cfg.max_seq_len
    ids, trained = tok.ids[: cfg.max_seq_len], tok.trained[: cfg.max_seq_len]
    pieces = list(zip(token_pieces(tokenizer, tok.text, tok.ids)[: len(ids)], map(bool, trained)))
    return RenderedExample(index, pieces, len(ids), sum(trained), truncated, fallback)


_THINKING_CACHE: dict[tuple, Any] = {}


def _thinking(cfg: DataConfig, ds, spec: FormatSpec):
    """data.thinking for the window's data set, as training resolves it (formats.data_thinking), read
    once per data set and column rather than once per example shown."""
    key = (id(ds), len(ds), spec.kind, tuple(spec.mapping.items()), cfg.thinking)
    if key not in _THINKING_CACHE:
        _THINKING_CACHE.clear()
        _THINKING_CACHE[key] = data_thinking(cfg.thinking, ds, spec)
    return _THINKING_CACHE[key]


def _piece_of(tokenizer, token_id: int) -> str:
    """One token's text on its own: its vocabulary entry with sentencepiece's '▁' and byte-level
    'Ġ' / 'Ċ' turned back into the blank and newline they stand for."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return tokenizer.decode([token_id])
    if "▁" in piece:
        return piece.replace("▁", " ")
    decoded = tokenizer.decode([token_id])
    return decoded if decoded.strip() or not piece.strip() else piece.replace("Ġ", " ").replace("Ċ", "\n")


def token_pieces(tokenizer, text: str, ids: list[int]) -> list[str]:
    """The characters of `text` each token stands for, blanks and newlines included (decoding one
    token alone loses a sentencepiece word's leading blank: "<|user|>Questionaboutvolcanoes").
    From the tokenizer's offsets where it gives them for this very text; else token by token."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer has no offsets
        enc = None
    if enc is None or list(enc["input_ids"]) != list(ids[: len(enc["input_ids"])]):
        return [_piece_of(tokenizer, i) for i in ids]
    pieces, seen = [], 0
    for token_id, (s, e) in zip(ids, enc["offset_mapping"]):
        # Two tokens of one multi-byte character share its offsets: the first shows it.
        piece = text[max(s, seen) : e] if e > max(s, seen) else ""
        pieces.append(piece if piece or e > s else _piece_of(tokenizer, token_id))
        seen = max(seen, e)
    pieces += [_piece_of(tokenizer, i) for i in ids[len(pieces) :]]  # a text row's appended EOS
    return pieces


def _render_preference(tokenizer, cfg: DataConfig, ds, index: int, kind: str) -> RenderedExample:
    """One preference row as training packs it: prompt + chosen, prompt + rejected (answers
    trained); KTO: prompt + answer."""
    from engine.data.preference import detect_preference_format, preference_thinking, prepare_preference_data

    # data.thinking "auto" read over the whole data set, as training reads it, not this row alone.
    spec = detect_preference_format(list(ds.column_names), kind, cfg.columns, cfg.source)
    thinking = preference_thinking(cfg.thinking, ds, spec)
    cfg = dataclasses.replace(cfg, thinking=thinking) if thinking is not None else cfg
    try:
        data = prepare_preference_data(cfg, tokenizer, kind, raw=ds.select([index]))
    except DataError as exc:
        raise DataError(f"row {shown_row(index)}: {str(exc).rsplit(': ', 1)[-1]}") from exc
    example = data.examples[0]
    if kind == "prompts":  # GRPO: the prompt as generation starts from it; the model writes the answers
        pieces = [(_piece_of(tokenizer, t), False) for t in example[0]]
        columns = {k: v for k, v in data.rows[0].items() if k not in data.spec.mapping.values()}
        return RenderedExample(index, pieces, len(pieces), 0, False, False, None, None, columns)
    parts = [(example[0], False), (example[1], True), (example[0], False), (example[2], True)]
    parts = parts[: {"paired": 4, "unpaired": 2}[kind]]
    pieces = [(_piece_of(tokenizer, t), trained) for ids, trained in parts for t in ids]
    # The same tokens per side (a KTO row's KL twin is another row's answer: not shown).
    names = ("prompt", "chosen", "rejected") if kind == "paired" else ("prompt", "completion")
    sides = {name: [(_piece_of(tokenizer, t), name != "prompt") for t in example[j]] for j, name in enumerate(names)}
    label = data.labels[0] if kind == "unpaired" else None
    return RenderedExample(
        index, pieces, len(pieces), sum(t for _, t in pieces), bool(data.truncated), False, sides, label
    )


def packing_layout(tokenizer, cfg: DataConfig, raw=None, method: str = "sft") -> PackingLayout:
    """`raw`: the rows to pack (engine.data.scan passes a bounded, cancellable view of them)."""
    from engine.data.dataset import prepare_dataset

    raw = _raw(cfg) if raw is None else raw
    pref = _preference_spec(cfg, list(raw.column_names), method)
    if pref is not None:
        from engine.data.preference import prepare_preference_data

        p = prepare_preference_data(cfg, tokenizer, pref.kind, raw=raw)
        rows = [[len(p.docs[d]) for d in row] for row in p.packing.rows]
        unpacked = len(p.docs) * max(map(len, p.docs))  # every example padded to the longest
        return PackingLayout(
            rows,
            p.packing.row_tokens,
            p.packing.efficiency,
            max(0, unpacked - len(rows) * p.packing.row_tokens),
            len(p.docs),
            p.truncated,
            0,
            p.skipped,
        )
    data = prepare_dataset(cfg, tokenizer, raw=raw)
    s = data.summary()
    rows = [[len(data.docs[d]) for d in row] for row in data.packing.rows]
    return PackingLayout(
        rows,
        data.packing.row_tokens,
        data.packing.efficiency,
        s["padding_avoided_tokens"],
        len(data.docs),
        data.truncated,
        data.dropped_overlong,
        data.skipped,
    )
