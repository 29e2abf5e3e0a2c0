"""What the run's fast-path report says about a path the hardware policy turned off, and the
checkpointing call that transformers no longer warns about (issue 28 items 10 and 11).

On this CPU machine the policy fills fast_paths.fused_ce / kernels / lora_autograd with false and
training.offload with "off"; the report said "disabled in config" / "fast_paths.X is false" for
them, although the user left them on auto."""

from __future__ import annotations

import warnings

import pytest

from engine.config import RunConfig
from engine.hardware import policy
from engine.hardware.profile import detect
from engine.models.loading import load_model
from engine.models.lora import attach_lora
from engine.train.step import enable_checkpointing, prepare_model


@pytest.fixture(scope="module")
def resolved():
    cfg = RunConfig()
    cfg.training.device = "cpu"
    return policy.apply_defaults(cfg, detect(), policy.model_info_for(cfg))


def _lora_model(cfg):
    return attach_lora(load_model(cfg.model, "cpu", "float32"), cfg.lora)


def test_an_off_the_policy_chose_says_so_with_its_reason(resolved):
    cfg = resolved
    assert cfg.fast_paths.fused_ce is False and "fast_paths.fused_ce" in cfg.auto_fields  # premise: CPU
    assert cfg.training.offload == "off" and "training.offload" in cfg.auto_fields
    t = cfg.training
    prepared = prepare_model(
        _lora_model(cfg),
        cfg.fast_paths,
        "cpu",
        bool(t.gradient_checkpointing),
        offload=t.offload,
        auto_reasons=cfg.auto_reasons,
    )
    report = prepared.report
    for key, path in (("fused_ce", "fast_paths.fused_ce"), ("offload", "training.offload")):
        assert report[key].startswith("off:") and "in config" not in report[key]
        assert cfg.auto_reasons[path] in report[key]  # the policy's own reason
    assert not any("in config" in line or line.endswith(" is false") for line in report.values()), report


def test_an_off_the_user_set_still_says_config(resolved):
    cfg = resolved.copy()
    cfg.fast_paths.fused_ce = False
    reasons = {k: v for k, v in cfg.auto_reasons.items() if k != "fast_paths.fused_ce"}  # set by the user
    prepared = prepare_model(_lora_model(cfg), cfg.fast_paths, "cpu", False, offload="off", auto_reasons=reasons)
    assert prepared.report["fused_ce"] == "off: disabled in config"


def test_lora_and_checkpointing_without_transformers_deprecation_warnings(resolved):
    base = load_model(resolved.model, "cpu", "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = attach_lora(base, resolved.lora)
        assert enable_checkpointing(model)
        prepare_model(model, resolved.fast_paths, "cpu", True, offload="off")
    noise = [str(w.message) for w in caught if "checkpointing" in str(w.message) and "deprecated" in str(w.message)]
    assert noise == []
    assert any(getattr(m, "gradient_checkpointing", False) for m in base.modules())  # and it is on
