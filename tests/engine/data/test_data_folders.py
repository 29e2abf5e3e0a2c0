"""Data set folders and subsets: what `huggingface-cli download --repo-type dataset` leaves (data files,
and a README declaring the subsets, as openai/gsm8k's "main" and "socratic"), a folder of split files,
and datasets' save_to_disk output, read offline by load_raw with data.subset and data.split. A folder
used to be refused ("is a folder; pick a file"), and a Hub data set with subsets could not be named at
all: datasets' "Config name is missing." was the whole message."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from engine.config import DataConfig
from engine.data.dataset import prepare_dataset
from engine.data.sources import DataError, load_raw

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# Sums
"""


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(tag: str, n: int) -> list[dict]:
    return [{"question": f"{tag}: what is {i} + 1?", "answer": f"Answer: {i + 1}"} for i in range(n)]


@pytest.fixture
def hub_download(tmp_path) -> Path:
    """A Hub data set's files with two subsets, as the Hub's download leaves them."""
    root = tmp_path / "gsm-like"
    _jsonl(root / "main" / "train-00000-of-00001.jsonl", _rows("main", 12))
    _jsonl(root / "main" / "test-00000-of-00001.jsonl", _rows("main test", 3))
    _jsonl(root / "socratic" / "train-00000-of-00001.jsonl", _rows("socratic", 7))
    (root / "README.md").write_text(README)
    return root


@pytest.fixture(scope="module")
def tokenizer():
    from engine.config import ModelConfig
    from engine.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig())


def test_a_subset_and_split_of_a_downloaded_hub_data_set(hub_download, tokenizer):
    raw = load_raw(DataConfig(source=str(hub_download), subset="socratic"))
    assert len(raw) == 7 and raw[0]["question"] == "socratic: what is 0 + 1?"
    raw = load_raw(DataConfig(source=str(hub_download), subset="main", split="test"))
    assert len(raw) == 3 and raw[2]["answer"] == "Answer: 3"
    data = prepare_dataset(DataConfig(source=str(hub_download), subset="main"), tokenizer)
    assert data.spec.kind == "instruction" and data.summary()["examples"] == 12


def test_the_subsets_and_splits_to_choose_from_are_named(hub_download):
    with pytest.raises(DataError) as missing:
        load_raw(DataConfig(source=str(hub_download)))
    assert str(missing.value) == (
        f"cannot read the data set folder {hub_download} (split 'train'): it has several subsets (main, socratic): "
        "pick one with data.subset (the Data page's Subset box)"
    )
    with pytest.raises(DataError, match=r"it has no subset 'mian'; its subsets: main, socratic \(data\.subset\)"):
        load_raw(DataConfig(source=str(hub_download), subset="mian"))
    with pytest.raises(
        DataError, match=r"\(subset 'socratic', split 'test'\): it has no split 'test'; its splits: train"
    ):
        load_raw(DataConfig(source=str(hub_download), subset="socratic", split="test"))


def test_a_folder_of_split_files_needs_no_subset(tmp_path):
    _jsonl(tmp_path / "plain" / "data" / "train.jsonl", _rows("train", 5))
    _jsonl(tmp_path / "plain" / "data" / "validation.jsonl", _rows("validation", 2))
    assert len(load_raw(DataConfig(source=str(tmp_path / "plain")))) == 5
    assert len(load_raw(DataConfig(source=str(tmp_path / "plain"), split="validation"))) == 2
    with pytest.raises(DataError, match=r"it has no split 'valid'; its splits: train, validation \(data\.split\)"):
        load_raw(DataConfig(source=str(tmp_path / "plain"), split="valid"))


def test_save_to_disk_output_one_data_set_or_one_per_split(tmp_path):
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(_rows("t", 6)), "test": datasets.Dataset.from_list(_rows("e", 2))}
    )
    both.save_to_disk(str(tmp_path / "dict"))
    assert len(load_raw(DataConfig(source=str(tmp_path / "dict")))) == 6
    assert len(load_raw(DataConfig(source=str(tmp_path / "dict"), split="test"))) == 2
    with pytest.raises(DataError, match=r"it has no split 'dev'; its splits: train, test \(data\.split\)"):
        load_raw(DataConfig(source=str(tmp_path / "dict"), split="dev"))
    datasets.Dataset.from_list(_rows("one", 4)).save_to_disk(str(tmp_path / "one"))
    assert len(load_raw(DataConfig(source=str(tmp_path / "one"), split="anything"))) == 4  # one data set: no splits


def test_a_folder_without_data_is_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^cannot read the data set folder .*empty \(split 'train'\): "):
        load_raw(DataConfig(source=str(tmp_path / "empty")))
