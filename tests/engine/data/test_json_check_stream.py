"""The check of a JSON / JSON Lines file before datasets reads it (engine.data.sources._check_json)
streams the file: its memory does not grow with the file, and it still names the file, the line
and what is wrong, for a JSON list too (whose items may span lines and chunks)."""

from __future__ import annotations

import json
import sys
import tracemalloc

import pytest

from engine.data import sources
from engine.data.sources import DataError, _check_json

ROW = {"messages": [{"role": "user", "content": "Say hi " * 20}, {"role": "assistant", "content": "Hi! " * 40}]}


def _peak_of_check(path) -> int:
    tracemalloc.start()
    try:
        _check_json(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["big.jsonl", "big.json"])
def test_the_check_of_a_big_file_holds_a_bounded_part_of_it(tmp_path, name):
    path = tmp_path / name
    line = json.dumps(ROW)
    n = 40_000  # about 20 MB
    with open(path, "w", encoding="utf-8") as f:
        if name.endswith(".json"):
            f.write("[\n" + ",\n".join([line] * n) + "\n]\n")
        else:
            f.write((line + "\n") * n)
    size = path.stat().st_size
    assert size > 15e6
    peak = _peak_of_check(path)
    # Reading it whole held the text and a list of its lines: over twice the file.
    assert peak < 4 * sources._CHUNK + 10 * len(line), (peak, size)


def test_a_line_with_a_unicode_line_separator_inside_a_string_is_one_row(tmp_path):
    """U+2028 is allowed raw inside a JSON string; str.splitlines() split the row there and the
    check called a good file malformed."""
    path = tmp_path / "sep.jsonl"
    path.write_text(json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    _check_json(path)


def _pretty_list(rows) -> str:
    return json.dumps(rows, indent=2)


def _both_errors(path, text: str) -> tuple[json.JSONDecodeError, str]:
    """Write `text` to `path`: json's own error for it, and the check's message for the file."""
    path.write_text(text, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    with pytest.raises(DataError) as err:
        _check_json(path)
    return expected.value, str(err.value)


@pytest.mark.parametrize("chunk", [16, 1 << 20])
def test_a_pretty_printed_list_passes_and_its_errors_name_the_line(tmp_path, monkeypatch, chunk):
    """With a chunk of 16 characters every item is cut by the buffer and read again with more lines."""
    monkeypatch.setattr(sources, "_CHUNK", chunk)
    rows = [{"text": f"row {i}", "meta": {"n": i, "tags": ["a", "b"]}} for i in range(30)]
    path = tmp_path / "pretty.json"
    path.write_text(_pretty_list(rows), encoding="utf-8")
    _check_json(path)

    text = _pretty_list(rows).splitlines()
    broken = text.copy()
    i = next(k for k, line in enumerate(text) if '"row 17"' in line)
    broken[i] = broken[i].rstrip(",")  # a missing comma after the text of row 17
    expected, message = _both_errors(path, "\n".join(broken))
    assert message == f"{path} line {expected.lineno}: malformed JSON ({expected.msg})"
    assert expected.lineno == i + 2

    # A trailing comma after the last item, the "]" many chunks further on: named where json names it.
    text = _pretty_list(rows)
    text = text[: text.rindex("}") + 1] + ",\n" + "\n" * 200 + "]\n"
    expected, message = _both_errors(path, text)
    assert message == f"{path} line {expected.lineno}: malformed JSON ({expected.msg})"


@pytest.mark.parametrize(
    "text, line, what",
    [
        ('[{"a": 1},\n {"a": 2}\n {"a": 3}]', 3, "Expecting ',' delimiter"),
        # A trailing comma: Python 3.13 and newer say so at the comma (line 1), older ones "Expecting value" at "]".
        (
            '[{"a": 1},\n]',
            1 if sys.version_info >= (3, 13) else 2,
            "trailing comma" if sys.version_info >= (3, 13) else "Expecting value",
        ),
        ('[{"a": 1},\n\n  ]', 1 if sys.version_info >= (3, 13) else 3, ""),
        ('[{"a": 1}]\n\n[]', 3, "Extra data"),
        ('[{"a": 1},\n {"a": ', 2, "Expecting value"),
        ('[{"a": 1},\n {"a": "b\n"}]', 2, "Invalid control character at"),
        ("[\n", 2, "Expecting value"),
    ],
)
def test_a_malformed_list_names_the_line_as_json_does(tmp_path, text, line, what):
    path = tmp_path / "bad.json"
    expected, message = _both_errors(path, text)
    assert message == f"{path} line {line}: malformed JSON ({expected.msg})"
    assert what in message


def test_an_item_that_is_not_an_object_is_named_with_its_line(tmp_path):
    path = tmp_path / "list.json"
    path.write_text('[\n  {"a": 1},\n  [1, 2]\n]\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        _check_json(path)
    assert str(err.value) == (
        f"{path} line 3: every item of the JSON list must be an object with fields; item 2 is list"
    )


def test_empty_and_blank_files_and_an_empty_list(tmp_path):
    for text in ("", "\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=r"empty\.jsonl is empty: it holds no examples"):
            _check_json(path)
    path = tmp_path / "none.json"
    path.write_text("  [ ]\n", encoding="utf-8")
    _check_json(path)  # datasets then says it holds no examples


def test_jsonl_errors_keep_their_line_and_column(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2,}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        _check_json(path)
    with pytest.raises(json.JSONDecodeError) as expected:  # this Python's words and column for the line
        json.loads('{"a": 2,}')
    assert str(err.value) == f"{path} line 3: malformed JSON ({expected.value.msg} at column {expected.value.colno})"
    path.write_text('{"a": 1}\n"text"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.jsonl line 2: expected a JSON object, got str"):
        _check_json(path)


def test_nul_and_bad_bytes_are_named_after_good_lines(tmp_path):
    path = tmp_path / "nul.json"
    path.write_bytes(b'[\n{"a": 1},\n{"a": "x\x00"}]\n')
    with pytest.raises(DataError, match=r"nul\.json line 3 contains NUL bytes"):
        _check_json(path)
    path = tmp_path / "latin.json"
    path.write_bytes(b'[\n{"a": 1},\n{"a": "caf\xe9"}]\n')
    with pytest.raises(DataError, match=r"latin\.json is not UTF-8 text: line 3, column 11"):
        _check_json(path)
