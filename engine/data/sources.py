"""Read a data set into a `datasets.Dataset`: the bundled demo, a local file, or a Hub id.

Local JSON/JSONL files are checked line by line first, so a malformed line is reported with
its file and line number instead of an Arrow stack trace.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Iterator

from engine.config import DataConfig
from engine.resources import DEMO_DATA_FILE

# File suffix -> the datasets builder that reads it (a .tsv is a CSV separated by tabs).
SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
# A data set folder: a Hub data set's files (data files, a README declaring its subsets) or datasets'
# save_to_disk output.
FOLDER = "folder"
# "a .json, .jsonl, .csv, .tsv or .parquet file": the words every message and the window use.
SUFFIX_WORDS = ", ".join(list(SUFFIXES)[:-1]) + " or " + list(SUFFIXES)[-1]


class DataError(ValueError):
    """The data cannot be used; the message names the file, row or field."""


def resolve_source(source: str) -> tuple[str, str | None]:
    """(path or Hub id, builder name: None for a Hub data set, FOLDER for a data set folder)."""
    if source == "demo":
        return str(DEMO_DATA_FILE), "json"
    p = Path(source).expanduser()
    suffix = p.suffix.lower()
    if suffix in SUFFIXES or p.exists() or source.startswith((".", "/", "~")):
        if not p.exists():
            raise DataError(f"data file {p} does not exist")
        if p.is_dir():
            return str(p), FOLDER
        if suffix not in SUFFIXES:
            raise DataError(f"{p}: unsupported file type '{suffix}'; use {SUFFIX_WORDS}")
        return str(p), SUFFIXES[suffix]
    return source, None


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF8_BOM = "\ufeff"


def _nul_error(path: Path, lineno: int) -> DataError:
    return DataError(f"{path} line {lineno} contains NUL bytes (\\x00): the file may be binary or UTF-16")


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a text file, read one line at a time, without a leading
    UTF-8 byte order mark; a DataError names the line and column of the first bytes that are not
    UTF-8, or the first line holding NUL bytes. A UTF-8 character never spans a newline byte, so
    each line decodes on its own."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
                hint = (
                    " (it starts with a UTF-16 byte order mark)" if lineno == 1 and raw.startswith(_UTF16_BOMS) else ""
                )
                raise DataError(
                    f"{path} is not UTF-8 text{hint}: line {lineno}, column {column} holds the byte "
                    f"0x{raw[exc.start]:02x}, which UTF-8 cannot decode; save the file as UTF-8"
                ) from exc
            if "\x00" in line:
                raise _nul_error(path, lineno)
            if lineno == 1 and line.startswith(_UTF8_BOM):
                # Windows tools (Notepad before 2019, PowerShell 5's Out-File) start UTF-8 files with a byte
                # order mark; datasets reads past it, json.loads does not.
                line = line[1:]
            yield lineno, line


def _check_text(path: Path) -> None:
    """Raise a DataError naming the first line of a text file that is not UTF-8 or holds NUL bytes."""
    try:
        for _ in _text_lines(path):
            pass
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


# Separators a CSV may use: the comma; the semicolon, which Excel writes where the comma is the decimal
# mark (much of Europe); the tab.
_DELIMITERS = (",", ";", "\t")


def csv_delimiter(path: Path) -> str:
    """The separator of a CSV file: a tab for .tsv; else the one of _DELIMITERS its header line holds
    most often outside quotes (a comma when it holds none)."""
    if Path(path).suffix.lower() == ".tsv":
        return "\t"
    header = ""
    try:
        for _, line in _text_lines(Path(path)):
            if line.strip():
                header = line
                break
    except (OSError, DataError):
        return ","  # the file's own check names what is wrong with it
    unquoted = header.split('"')[0::2]  # the text outside double quotes
    counts = {d: sum(part.count(d) for part in unquoted) for d in _DELIMITERS}
    best = max(_DELIMITERS, key=lambda d: counts[d])  # ties keep the earlier: the comma first
    return best if counts[best] else ","


def _check_parquet(path: Path) -> None:
    """A file that is not Parquet (or is cut short) is named here, before datasets reads it: its
    Parquet builder logs 'Failed to read schema from ... ArrowInvalid' to stderr for such a file
    and then raises, so the person saw that line beside our own sentence."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file (cut short, or another format): {exc}") from exc


def _check_json(path: Path) -> None:
    """Raise a DataError naming the first malformed line of a JSON or JSON Lines file. The file is
    read a line (a JSON list: a chunk of lines) at a time: reading it whole was most of the X-ray's
    peak memory on a big file (a 300 MB file held as text and again as a list of lines)."""
    try:
        lines = _text_lines(path)
        for lineno, line in lines:
            if line.strip():
                break
        else:
            raise DataError(f"{path} is empty: it holds no examples")
        if line.lstrip().startswith("[") and path.suffix.lower() == ".json":
            _check_json_list(path, lineno, line, lines)
            return
        for lineno, line in itertools.chain([(lineno, line)], lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


_CHUNK = 1 << 20  # characters of whole lines a JSON list's check reads at a time (more for a longer item)
_BLANK = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _trailing_comma_words() -> tuple[str, bool]:
    """How this Python's json words a list's trailing comma, and whether it points at the comma: from 3.13
    on "Illegal trailing comma before end of array" at the comma, before that "Expecting value" at the "]"."""
    try:
        json.loads("[0,]")
    except json.JSONDecodeError as exc:
        return exc.msg, exc.pos == 2
    return "Expecting value", False


_TRAILING_COMMA = _trailing_comma_words()


def _check_json_list(path: Path, lineno: int, first: str, lines: Iterator[tuple[int, str]]) -> None:
    """Check a JSON list item by item, holding whole lines of the file from the item being read on:
    an item the buffer cuts short is read again with more lines (at least as many characters as it
    already holds, so a long item is parsed a bounded number of times). `first` is line `lineno`,
    the first that is not blank, and opens the list."""
    decoder = json.JSONDecoder()
    buf, base = first, lineno  # the text held, and the line number of its first character
    pos = buf.index("[") + 1
    state, items = "first", 0  # what comes next: "first" (an item or "]"), "item", "delimiter", "end"
    comma_line = lineno  # the line of the last comma between items (a refill drops the text before pos)

    def refill() -> bool:
        nonlocal buf, base, pos
        base += buf.count("\n", 0, pos)
        held, want = [buf[pos:]], max(_CHUNK, len(buf) - pos)
        size = 0
        for _, line in lines:
            held.append(line)
            size += len(line)
            if size >= want:
                break
        buf, pos = "".join(held), 0
        return size > 0

    def malformed(at: int, msg: str) -> DataError:
        return DataError(f"{path} line {base + buf.count(chr(10), 0, at)}: malformed JSON ({msg})")

    while True:
        pos = _BLANK.match(buf, pos).end()
        if pos == len(buf):
            if refill():
                continue
            if state != "end":
                raise malformed(pos, "Expecting value" if state in ("first", "item") else "Expecting ',' delimiter")
            return
        if state == "end":
            raise malformed(pos, "Extra data")
        if state == "delimiter":
            if buf[pos] not in ",]":
                raise malformed(pos, "Expecting ',' delimiter")
            if buf[pos] == ",":
                comma_line = base + buf.count("\n", 0, pos)
            state = "item" if buf[pos] == "," else "end"
            pos += 1
            continue
        if state == "item" and buf[pos] == "]":
            words, at_comma = _TRAILING_COMMA
            if at_comma:
                raise DataError(f"{path} line {comma_line}: malformed JSON ({words})")
            raise malformed(pos, words)
        if state == "first" and buf[pos] == "]":
            state, pos = "end", pos + 1
            continue
        try:
            row, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            # Nothing but blanks after where it stopped: the item goes on past the lines held.
            if not buf[exc.pos :].strip() and refill():
                continue
            raise malformed(exc.pos, exc.msg) from exc
        items += 1
        if not isinstance(row, dict):
            raise DataError(
                f"{path} line {base + buf.count(chr(10), 0, pos)}: every item of the JSON list must be an object "
                f"with fields; item {items} is {type(row).__name__}"
            )
        state, pos = "delimiter", end


def _which(cfg: DataConfig) -> str:
    """ " (subset 'main', split 'train')": what was asked of a data set with subsets and splits."""
    return f" (subset '{cfg.subset}', split '{cfg.split}')" if cfg.subset else f" (split '{cfg.split}')"


def _load_words(exc: Exception, cfg: DataConfig) -> str:
    """datasets' reason a data set did not load, in one clause. Where it lists the subsets or splits to
    choose from (a data set with several subsets and none named says only "Config name is missing." on its
    first line, the subsets on the next), they are named here with the setting that picks one."""
    text = str(exc)
    first = text.splitlines()[0] if text else type(exc).__name__
    listed = re.search(r"\[([^\]]*)\]", text)
    if not (listed and isinstance(exc, ValueError)):
        return first.rstrip(".")
    names = ", ".join(n.strip().strip("'\"") for n in listed.group(1).split(","))
    lower = text.lower()
    if "config name is missing" in lower:
        return f"it has several subsets ({names}): pick one with data.subset (the Data page's Subset box)"
    if "config" in lower and cfg.subset:
        return f"it has no subset '{cfg.subset}'; its subsets: {names} (data.subset)"
    if "split" in lower:
        return f"it has no split '{cfg.split}'; its splits: {names} (data.split)"
    return first.rstrip(".")


def _load_folder(path: Path, cfg: DataConfig):
    """A data set folder: datasets' save_to_disk output (one data set, or one per split), else a Hub data
    set's files (load_dataset reads its README's subsets and names its splits from the file names)."""
    import datasets

    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            saved = datasets.load_from_disk(str(path))
            if not isinstance(saved, datasets.DatasetDict):
                return saved
            if cfg.split not in saved:
                raise DataError(
                    f"cannot read the data set folder {path}{_which(cfg)}: it has no split '{cfg.split}'; "
                    f"its splits: {', '.join(saved)} (data.split)"
                )
            return saved[cfg.split]
        return datasets.load_dataset(str(path), cfg.subset or None, split=cfg.split)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot read the data set folder {path}{_which(cfg)}: {_load_words(exc, cfg)}") from exc


def load_raw(cfg: DataConfig):
    """The raw rows as a datasets.Dataset (Arrow-backed: rows are read lazily)."""
    import datasets

    datasets.disable_progress_bars()
    source, builder = resolve_source(cfg.source)
    try:
        if builder is None:
            try:
                ds = datasets.load_dataset(source, cfg.subset or None, split=cfg.split)
            except Exception as exc:  # the Hub raises many types; all mean "cannot get it"
                words = _load_words(exc, cfg)
                # Unless the reason names a subset or split to pick, the id or the connection is wrong.
                advice = (
                    ""
                    if words.endswith(("(data.subset)", "(data.split)", "Subset box)"))
                    else (". Check the id and the connection, or pick a local file")
                )
                raise DataError(
                    f"cannot load the data set '{source}'{_which(cfg)} from the Hugging Face Hub: {words}{advice}"
                ) from exc
        elif builder == FOLDER:
            ds = _load_folder(Path(source), cfg)
        else:
            path = Path(source)
            if builder == "json":
                _check_json(path)
            elif path.stat().st_size == 0:
                raise DataError(f"{path} is empty: it holds no examples")
            elif builder == "csv":
                _check_text(path)
            elif builder == "parquet":
                _check_parquet(path)
            options = {"delimiter": csv_delimiter(path)} if builder == "csv" else {}
            try:
                ds = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
            except Exception as exc:
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise DataError(f"cannot read {path} as {builder.upper()}: {text}") from exc
    except PermissionError as exc:
        raise DataError(f"cannot read {source}: permission denied") from exc
    if len(ds) == 0:
        raise DataError(f"{source} holds no examples")
    if cfg.max_examples and len(ds) > cfg.max_examples:
        ds = ds.select(range(cfg.max_examples))
    return ds
