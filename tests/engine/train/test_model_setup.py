"""The session's model step on its own (engine.train.model_setup): a tiny model from the shared
factory, saved as a local folder, loaded with LoRA and the fast paths as the session does."""

import shutil

import pytest
import torch
from tiny_models import tiny_model

from engine.config import RunConfig
from engine.resources import DEMO_MODEL_DIR, DEMO_PRESET
from engine.train.distributed import DistContext
from engine.train.model_setup import setup_model
from engine.train.run_setup import configure


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A local model folder as a person would have one: the weights and the demo's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_MODEL_DIR / f).exists():
            shutil.copy(DEMO_MODEL_DIR / f, path / f)
    return path


def configured(tmp_path, tiny_dir, **lora):
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.name_or_path = str(tiny_dir)
    cfg.training.device = "cpu"
    cfg.output.dir = str(tmp_path)
    for k, v in lora.items():
        setattr(cfg.lora, k, v)
    return configure(cfg, DistContext(), None, None, None)


def test_the_model_trains_only_its_lora_and_says_so(tmp_path, tiny_dir):
    run = configured(tmp_path, tiny_dir, r=4)
    logs, offloaders = [], []

    def offloader():
        offloaders.append(1)
        return None

    built = setup_model(
        run.config, run.device, DistContext(), False, None, run.objective, offloader, lambda m, *a: logs.append(m)
    )
    named = dict(built.model.named_parameters())
    lora = {n for n, p in named.items() if "lora_" in n}
    assert lora and {id(p) for p in built.params} == {id(named[n]) for n in lora}
    assert all(p.requires_grad for p in built.params)
    assert not any(p.requires_grad for n, p in named.items() if n not in lora)  # the base stays frozen
    assert built.model.training and built.ddp is None  # one process: the loss is called directly
    assert built.prepared.model is built.model and set(built.prepared.report) >= {"fused_ce", "packed_attention"}
    assert logs[0] == f"Loading model {tiny_dir} on cpu ({run.config.model.dtype})"
    n_train = sum(p.numel() for p in built.params)
    assert logs[-1].startswith(f"LoRA: {n_train:,} trainable parameters; fast paths: packed_attention=")
    # The run's forward asks for the offloader when it runs (recovery may change it mid-run).
    assert built.forward.offloader is offloader and not offloaders


def test_lora_starts_from_an_earlier_adapter(tmp_path, tiny_dir):
    from engine.peft_model import init_adapter_path

    first = configured(tmp_path, tiny_dir, r=4)
    earlier = setup_model(first.config, first.device, DistContext(), False, None, first.objective, lambda: None, print)
    with torch.no_grad():
        for p in earlier.params:
            p.normal_(0.0, 0.02)  # PEFT starts B at zero: a copy of zeros would prove nothing
    earlier.model.save_pretrained(tmp_path / "earlier")
    logs = []
    run = configured(tmp_path, tiny_dir, r=4, init_adapter=str(tmp_path / "earlier"))
    assert run.init_adapter == init_adapter_path(str(tmp_path / "earlier"))
    built = setup_model(
        run.config, run.device, DistContext(), False, run.init_adapter, run.objective, lambda: None, logs.append
    )
    assert len(built.params) == len(earlier.params)
    for a, b in zip(built.params, earlier.params, strict=True):
        assert torch.equal(a, b)
    assert f"LoRA starts from the adapter in {run.init_adapter} ({len(built.params)} tensors)" in logs
