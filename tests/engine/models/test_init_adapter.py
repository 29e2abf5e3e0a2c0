"""`lora.init_adapter`: a run's LoRA starts from an earlier adapter (a PEFT folder or a run),
loaded into the session's fresh adapters before the fast paths are set up; a path that holds
none, or an adapter of other LoRA settings, fails the run with a message naming the field."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.events import Failed
from engine.train.session import TrainingSession
from tests.engine.train.test_session import run, tiny_config


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A finished two-step SFT run on the demo (its final adapter and checkpoint step-2)."""
    cfg = tiny_config(tmp_path_factory.mktemp("earlier"), steps=2, save_every=2)
    result, _ = run(cfg)
    return result.run_dir


def test_the_adapter_weights_are_loaded_into_the_fresh_lora(earlier):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.config import LoraConfig, RunConfig
    from engine.models.lora import attach_lora
    from engine.peft_model import init_adapter_path, load_init_adapter
    from engine.resources import DEMO_MODEL_DIR, DEMO_PRESET

    lora: LoraConfig = RunConfig.load(DEMO_PRESET).lora
    folder = init_adapter_path(earlier)
    assert folder.name == "adapter"  # a run: its final adapter first
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR), str(folder))
    fresh = attach_lora(AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR), lora)
    names = [k for k in fresh.state_dict() if "lora_B" in k]
    assert names and all(fresh.state_dict()[k].abs().max() == 0 for k in names)  # PEFT starts B at 0
    n = load_init_adapter(fresh, folder)
    ours, theirs = fresh.state_dict(), reference.state_dict()
    assert n == len([k for k in ours if "lora_" in k])
    for k in (k for k in ours if "lora_" in k):
        assert torch.equal(ours[k], theirs[k]), k


def test_a_run_starts_from_a_checkpoint_adapter(earlier, tmp_path):
    cfg = tiny_config(tmp_path, steps=1)
    cfg.lora.init_adapter = f"{earlier}/checkpoints/step-2"
    result, events = run(cfg)
    logs = [e.message for e in events if type(e).__name__ == "LogLine"]
    assert any(f"LoRA starts from the adapter in {earlier}/checkpoints/step-2/adapter" in m for m in logs), logs


def test_a_path_without_an_adapter_fails_before_the_run_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    for source, words in [(tmp_path / "nowhere", "no such folder"), (tmp_path / "empty", "is not a PEFT adapter")]:
        cfg = tiny_config(tmp_path / "runs", steps=1)
        cfg.lora.init_adapter = str(source)
        result = TrainingSession(cfg, None).run()
        assert isinstance(result, Failed)
        assert "lora.init_adapter" in result.message and words in result.message, result.message
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_an_adapter_of_other_lora_settings_is_refused_by_name(earlier, tmp_path):
    from transformers import AutoModelForCausalLM

    from engine.config import RunConfig
    from engine.models.lora import attach_lora
    from engine.peft_model import load_init_adapter
    from engine.resources import DEMO_MODEL_DIR, DEMO_PRESET

    lora = RunConfig.load(DEMO_PRESET).lora
    lora.r = 8
    lora.target_modules = ["q_proj", "v_proj"]
    model = attach_lora(AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR), lora)
    with pytest.raises(ConfigError) as err:
        load_init_adapter(model, f"{earlier}/adapter")
    assert err.value.path == "lora.init_adapter"
    assert "r 16 there, 8 here" in str(err.value) and "target modules" in str(err.value)
    # Through the session: the run fails with the same message.
    cfg = tiny_config(tmp_path, steps=1)
    cfg.lora.r = 8
    cfg.lora.init_adapter = earlier
    result = TrainingSession(cfg, None).run()
    assert (
        isinstance(result, Failed) and "lora.init_adapter" in result.message and "r 16 there, 8 here" in result.message
    )
