"""A file named .parquet that is not Parquet is refused in one sentence naming it, without the
'Failed to read schema ... ArrowInvalid' line datasets' Parquet builder logged for it (issue 28
item 11)."""

from __future__ import annotations

import pytest

from engine.config import DataConfig
from engine.data.sources import DataError, load_raw


@pytest.mark.parametrize("content", [b"instruction,output\nq,a\n", b"PAR1 cut short"])
def test_a_bad_parquet_file_is_named_without_library_noise(tmp_path, capfd, content):
    path = tmp_path / "rows.parquet"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        load_raw(DataConfig(source=str(path)))
    assert str(path) in str(err.value) and "Parquet" in str(err.value)
    out, errors = capfd.readouterr()
    assert "Failed to read schema" not in out + errors and "ArrowInvalid" not in out + errors


def test_a_good_parquet_file_still_loads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"instruction": ["q1", "q2"], "output": ["a1", "a2"]}), path)
    ds = load_raw(DataConfig(source=str(path)))
    assert len(ds) == 2 and ds[1]["output"] == "a2"
