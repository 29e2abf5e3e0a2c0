"""A model folder's broken config.json is named as such, with the JSON error's line (issue 28 item
10: it was refused as 'holds no weights' although the weights were there)."""

from __future__ import annotations

import shutil

import pytest

from engine.api import ModelLoadError, check_model_folder
from engine.config import ModelConfig
from engine.models.loading import load_tokenizer
from engine.resources import DEMO_MODEL_DIR


def _demo_with_config(tmp_path, text: str):
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    (folder / "config.json").write_text(text, encoding="utf-8")
    return folder


BROKEN = '{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n'


def test_check_model_folder_names_the_broken_config_and_its_line(tmp_path):
    folder = _demo_with_config(tmp_path, BROKEN)
    problems = check_model_folder(str(folder))
    assert len(problems) == 1  # the weights and tokenizer are there: only the config is wrong
    assert "config.json" in problems[0] and "line 3" in problems[0]
    assert "weights" not in problems[0]


def test_loading_refuses_the_broken_config_with_its_line(tmp_path):
    folder = _demo_with_config(tmp_path, BROKEN)
    with pytest.raises(ModelLoadError, match=r"config\.json.*line 3"):
        load_tokenizer(ModelConfig(name_or_path=str(folder)))


def test_a_config_that_is_not_an_object(tmp_path):
    folder = _demo_with_config(tmp_path, "[1, 2]\n")
    problems = check_model_folder(str(folder))
    assert len(problems) == 1 and "config.json" in problems[0]


def test_a_broken_config_without_weights_says_both(tmp_path):
    folder = _demo_with_config(tmp_path, BROKEN)
    (folder / "model.safetensors").unlink()
    problems = check_model_folder(str(folder))
    assert "line 3" in problems[0] and any("no weights" in p for p in problems[1:])


@pytest.mark.parametrize(
    "name,words",
    [
        ("model.Q4_K_M.gguf", "is a GGUF file, llama.cpp's format for running a model: training needs the model's "),
        ("model.safetensors", "is one weights file: pick the folder that holds it with its config.json and tokenizer"),
        ("notes.txt", "is not a folder: pick a Hugging Face model folder"),
    ],
)
def test_a_file_given_as_the_model_is_named_by_what_it_is(tmp_path, name, words):
    path = tmp_path / name
    path.write_bytes(b"GGUF" if name.endswith(".gguf") else b"x")
    problems = check_model_folder(str(path))
    assert len(problems) == 1 and problems[0].startswith(f"{path} {words}")
    with pytest.raises(ModelLoadError, match=words.split(":")[0]):
        load_tokenizer(ModelConfig(name_or_path=str(path)))


def test_loading_and_the_window_give_the_same_first_reason(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    for f in folder.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    problems = check_model_folder(str(folder))
    assert problems == [
        f"{folder} holds only pickle weights (model.bin), which can run code when loaded; convert them to "
        "safetensors or set model.allow_pickle: true if you trust them"
    ]
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer(ModelConfig(name_or_path=str(folder)))
    assert str(refused.value) == problems[0]
