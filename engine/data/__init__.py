"""Data: sources (files, Hub, bundled demo), format detection and column mapping, chat
rendering with response-only masks, and best-fit-decreasing packing into PackedBatch rows."""


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 row"``, ``"0 rows"``, ``"2 rows"``: the count and the noun, plural unless n == 1."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
