"""Data: sources (files, Hub, bundled demo), format detection and column mapping, chat
rendering with response-only masks, and best-fit-decreasing packing into PackedBatch rows."""


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 row"``, ``"0 rows"``, ``"2 rows"``: the count and the noun, plural unless n == 1."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def shown_row(index: int) -> int:
    """The number a person reads for the row at 0-based `index`: rows count from 1, like the lines
    of the file (a JSONL file's row 1 is its line 1) and like every editor and spreadsheet.
    Indices stay 0-based inside; this is the one place that turns one into the other."""
    return int(index) + 1
