"""Columns that match no shape: one structured error (file, columns, what to pick, config key),
and a CSV whose first row looks like data gets the "no header row" hint."""

from __future__ import annotations

import pytest

from engine.config import DataConfig
from engine.data import preview
from engine.data.formats import NO_HEADER_HINT, UnmatchedColumns, detect_format, header_looks_like_data
from engine.data.sources import DataError


def test_unmatched_columns_name_the_file_the_columns_and_both_ways_to_map(tmp_path):
    with pytest.raises(UnmatchedColumns) as info:
        detect_format(["q", "a"], source=str(tmp_path / "qa.jsonl"))
    err = info.value
    assert isinstance(err, DataError)
    assert err.columns == ["q", "a"] and "instruction" in err.kinds and err.hint == ""
    text = str(err)
    assert "qa.jsonl" in text and "q, a" in text and "match no known shape" in text
    assert "which column holds the prompt and which the answer" in text
    assert "data.columns: {instruction: COLUMN, output: COLUMN}" in text and "Data page" in text


def test_csv_without_header_gets_the_hint(tmp_path):
    path = tmp_path / "noheader.csv"
    rows = [(f"What is {i} plus one, written as a number?", f"It is {i + 1}.") for i in range(10)]
    path.write_text("".join(f'"{q}","{a}"\n' for q, a in rows), encoding="utf-8")
    p = preview.load_preview(DataConfig(source=str(path)))
    assert p.format is None and NO_HEADER_HINT in p.error
    assert isinstance(p.error_detail, UnmatchedColumns) and p.error_detail.hint == NO_HEADER_HINT
    assert "noheader.csv" in p.error

    # Numeric "names", and names that repeat values of later rows, read as data too.
    assert header_looks_like_data(["1", "2.5"])
    assert header_looks_like_data(["yes", "no"], [["no", "yes"], ["yes", "yes"]])


def test_csv_with_a_real_header_gets_no_hint(tmp_path):
    path = tmp_path / "header.csv"
    path.write_text("q,a\n" + "".join(f"What is {i}?,It is {i}.\n" for i in range(5)), encoding="utf-8")
    p = preview.load_preview(DataConfig(source=str(path)))
    assert p.format is None and p.error_detail.hint == "" and "header row" not in p.error
    assert not header_looks_like_data(["q", "a"], [["What is 1?", "It is 1."]])
