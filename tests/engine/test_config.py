"""RunConfig: YAML round trip and validation errors that name the field."""

import pytest

from engine.config import ConfigError, RunConfig
from engine.resources import DEMO_PRESET


def test_demo_preset_loads_and_round_trips(tmp_path):
    cfg = RunConfig.load(DEMO_PRESET)
    assert cfg.model.name_or_path == "demo"
    path = tmp_path / "c.yaml"
    cfg.save(path)
    assert RunConfig.load(path) == cfg


def test_unknown_field_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"lr": 1e-4, "max_step": 3}})
    assert err.value.path == "training.max_step"
    assert "did you mean 'max_steps'" in str(err.value)


def test_wrong_type_names_field():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"lora": {"r": "sixteen"}})
    assert err.value.path == "lora.r"
    assert "integer" in str(err.value)


def test_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"scheduler": "step"}})
    assert err.value.path == "training.scheduler"
    assert "'cosine'" in str(err.value) and "'linear'" in str(err.value)


def test_range_checked_and_scientific_strings_read(tmp_path):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"lr": -1.0}})
    assert err.value.path == "training.lr"
    p = tmp_path / "c.yaml"
    p.write_text("training:\n  lr: 2e-4\n")  # YAML 1.1 reads this as a string
    assert RunConfig.load(p).training.lr == pytest.approx(2e-4)


def test_bad_yaml_names_the_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        RunConfig.load(p)


def test_grpo_without_a_reward_is_refused_before_anything_loads():
    """A GRPO config with no reward function is a config error naming grpo.rewards and what it may
    hold (it failed after the model loaded, as 'Training failed: RewardError')."""
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"training": {"method": "grpo"}}).validate()
    assert err.value.path == "grpo.rewards" and "kind: exact, column: answer" in str(err.value)
    RunConfig.from_dict({"training": {"method": "grpo"}, "grpo": {"rewards": [{"kind": "length"}]}}).validate()
    RunConfig.from_dict({"training": {"method": "sft"}}).validate()  # other methods need none
