"""Data files as Windows tools save them: a UTF-8 byte order mark (Notepad before 2019, PowerShell 5's
`Out-File -Encoding utf8`) and CRLF line ends. datasets reads past both; the line checks that run
before it (engine.data.sources) used to stop at the mark with "malformed JSON (Unexpected UTF-8 BOM)"."""

from __future__ import annotations

import json

import pytest

from engine.config import DataConfig
from engine.data.dataset import prepare_dataset
from engine.data.sources import DataError, csv_delimiter, load_raw

BOM = b"\xef\xbb\xbf"
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + 1?"},
            {"role": "assistant", "content": f"Answer: {i + 1}"},
        ]
    }
    for i in range(12)
]


def _windows(path, text: str):
    path.write_bytes(BOM + text.replace("\n", "\r\n").encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from engine.config import ModelConfig
    from engine.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig())


@pytest.mark.parametrize("name", ["rows.jsonl", "list.json"])
def test_json_with_a_byte_order_mark_and_crlf_reads_every_row(tmp_path, tokenizer, name):
    text = "".join(json.dumps(r) + "\n" for r in ROWS) if name.endswith("l") else json.dumps(ROWS, indent=2)
    path = _windows(tmp_path / name, text)
    raw = load_raw(DataConfig(source=str(path)))
    assert raw.column_names == ["messages"] and len(raw) == len(ROWS)
    assert raw[0]["messages"][0]["content"] == "What is 0 + 1?"
    data = prepare_dataset(DataConfig(source=str(path)), tokenizer)
    assert data.summary()["examples"] == len(ROWS) and data.summary()["skipped"] == 0


def test_csv_with_a_byte_order_mark_keeps_its_first_column_name(tmp_path):
    text = "instruction,output\n" + "".join(f"What is {i} + 1?,Answer: {i + 1}\n" for i in range(12))
    raw = load_raw(DataConfig(source=str(_windows(tmp_path / "rows.csv", text))))
    assert raw.column_names == ["instruction", "output"] and len(raw) == 12


def test_an_error_after_the_mark_still_names_its_line_and_column(tmp_path):
    text = json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"messages": [}\n'
    path = _windows(tmp_path / "bad.jsonl", text)
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: malformed JSON \(Expecting value at column 15\)"):
        load_raw(DataConfig(source=str(path)))
    # On the first line the column counts from after the mark, as an editor shows it.
    path = _windows(tmp_path / "first.jsonl", '{"messages": [}\n')
    with pytest.raises(DataError, match=r"first\.jsonl line 1: malformed JSON \(Expecting value at column 15\)"):
        load_raw(DataConfig(source=str(path)))


def test_semicolon_csv_from_a_european_excel_reads_its_columns(tmp_path, tokenizer):
    # Excel quotes a field holding the separator; commas inside text are plain characters here.
    text = "instruction;output\n" + "".join(f'"What is {i}; and {i}, again?";Answer: {i + 1}\n' for i in range(12))
    path = _windows(tmp_path / "rows.csv", text)
    assert csv_delimiter(path) == ";"
    raw = load_raw(DataConfig(source=str(path)))
    assert raw.column_names == ["instruction", "output"] and len(raw) == 12
    assert raw[3] == {"instruction": "What is 3; and 3, again?", "output": "Answer: 4"}
    assert prepare_dataset(DataConfig(source=str(path)), tokenizer).summary()["examples"] == 12


def test_a_tsv_file_is_read_by_tabs(tmp_path):
    path = tmp_path / "rows.tsv"
    path.write_text("instruction\toutput\n" + "".join(f"Say {i}, twice\tAnswer: {i}; {i}\n" for i in range(5)))
    raw = load_raw(DataConfig(source=str(path)))
    assert raw.column_names == ["instruction", "output"] and raw[2] == {
        "instruction": "Say 2, twice",
        "output": "Answer: 2; 2",
    }


def test_the_header_decides_and_a_comma_wins_ties_and_quotes(tmp_path):
    cases = {
        "plain.csv": "text\nHello; there\n",  # one column: the comma, whatever the rows hold
        "quoted.csv": '"a;b",output\nx,y\n',  # a semicolon inside a quoted name is not a separator
        "tie.csv": "a,b;c\n1,2;3\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert csv_delimiter(tmp_path / name) == ",", name
