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

SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """The data cannot be used; the message names the file, row or field."""


def resolve_source(source: str) -> tuple[str, str | None]:
    """(path or Hub id, builder name or None for a Hub data set)."""
    if source == "demo":
        return str(DEMO_DATA_FILE), "json"
    p = Path(source).expanduser()
    suffix = p.suffix.lower()
    if suffix in SUFFIXES or p.exists() or source.startswith((".", "/", "~")):
        if not p.exists():
            raise DataError(f"data file {p} does not exist")
        if p.is_dir():
            raise DataError(f"{p} is a folder; pick a .json, .jsonl, .csv or .parquet file")
        if suffix not in SUFFIXES:
            raise DataError(f"{p}: unsupported file type '{suffix}'; use .json, .jsonl, .csv or .parquet")
        return str(p), SUFFIXES[suffix]
    return source, None


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _nul_error(path: Path, lineno: int) -> DataError:
    return DataError(f"{path} line {lineno} contains NUL bytes (\\x00): the file may be binary or UTF-16")


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a text file, read one line at a time; a DataError names
    the line and column of the first bytes that are not UTF-8, or the first line holding NUL bytes.
    A UTF-8 character never spans a newline byte, so each line decodes on its own."""
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
            yield lineno, line


def _check_text(path: Path) -> None:
    """Raise a DataError naming the first line of a text file that is not UTF-8 or holds NUL bytes."""
    try:
        for _ in _text_lines(path):
            pass
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


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


def load_raw(cfg: DataConfig):
    """The raw rows as a datasets.Dataset (Arrow-backed: rows are read lazily)."""
    import datasets

    datasets.disable_progress_bars()
    source, builder = resolve_source(cfg.source)
    try:
        if builder is None:
            try:
                ds = datasets.load_dataset(source, split=cfg.split)
            except Exception as exc:  # the Hub raises many types; all mean "cannot get it"
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise DataError(
                    f"cannot load the data set '{source}' (split '{cfg.split}') from the Hugging Face Hub: "
                    f"{text}. Check the id and the connection, or pick a local file"
                ) from exc
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
            try:
                ds = datasets.load_dataset(builder, data_files=str(path), split="train")
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
