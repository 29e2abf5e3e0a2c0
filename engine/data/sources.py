"""Read a data set into a `datasets.Dataset`: the bundled demo, a local file, or a Hub id.

Local JSON/JSONL files are checked line by line first, so a malformed line is reported with
its file and line number instead of an Arrow stack trace.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _check_text(path: Path, nul: bool = True) -> None:
    """Raise a DataError naming the line and column of the first bytes of a text file that are not
    UTF-8 (and, with `nul`, the first line holding NUL bytes). Reads line by line: a UTF-8
    character never spans a newline byte, so each line decodes on its own."""
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
                    hint = (
                        " (it starts with a UTF-16 byte order mark)"
                        if lineno == 1 and raw.startswith(_UTF16_BOMS)
                        else ""
                    )
                    raise DataError(
                        f"{path} is not UTF-8 text{hint}: line {lineno}, column {column} holds the byte "
                        f"0x{raw[exc.start]:02x}, which UTF-8 cannot decode; save the file as UTF-8"
                    ) from exc
                if nul and "\x00" in line:
                    raise _nul_error(path, lineno)
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
    """Raise a DataError naming the first malformed line of a JSON or JSON Lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        _check_text(path, nul=False)  # raises, naming the line and column
        raise  # pragma: no cover - the line scan always finds what the whole-file decode found
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if "\x00" in text:
        raise _nul_error(path, text.count("\n", 0, text.index("\x00")) + 1)
    stripped = text.lstrip()
    if not stripped:
        raise DataError(f"{path} is empty: it holds no examples")
    if stripped.startswith("[") and path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {exc.lineno}: malformed JSON ({exc.msg})") from exc
        if not all(isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: every item of the JSON list must be an object with fields")
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(row, dict):
            raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")


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
