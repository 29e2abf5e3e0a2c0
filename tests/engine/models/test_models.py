"""Model loading: bad folders, pickle refusal, and the offline Hub message."""

import shutil

import pytest

from engine.config import ModelConfig
from engine.models.loading import ModelLoadError, load_model, load_tokenizer
from engine.resources import DEMO_MODEL_DIR


def copy_demo(tmp_path, skip=()):
    dst = tmp_path / "model"
    dst.mkdir()
    for f in DEMO_MODEL_DIR.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def test_demo_model_loads():
    model = load_model(ModelConfig(), "cpu", "float32")
    tok = load_tokenizer(ModelConfig())
    assert model.config.model_type == "llama"
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_folder_without_weights(tmp_path):
    folder = copy_demo(tmp_path, skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="holds no weights"):
        load_model(ModelConfig(name_or_path=str(folder)), "cpu", "float32")


def test_folder_without_tokenizer(tmp_path):
    folder = copy_demo(tmp_path, skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_tokenizer(ModelConfig(name_or_path=str(folder)))


def test_pickle_weights_refused_unless_allowed(tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = copy_demo(tmp_path, skip=("model.safetensors",))
    torch.save(load_file(DEMO_MODEL_DIR / "model.safetensors"), folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(ModelConfig(name_or_path=str(folder)), "cpu", "float32")
    model = load_model(ModelConfig(name_or_path=str(folder), allow_pickle=True), "cpu", "float32")
    assert model.config.model_type == "llama"


def test_missing_folder_and_unreachable_hub(monkeypatch):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelConfig(name_or_path="./no/such/folder"), "cpu", "float32")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Hub"):
        load_tokenizer(ModelConfig(name_or_path="someone/model-that-is-not-cached"))
