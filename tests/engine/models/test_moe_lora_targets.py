"""MoE families whose experts transformers 5 fused, with dense MLPs beside them (shared experts,
dense first layers): "all-linear" trains the dense MLPs and the attention, never the experts, and
the saved adapter loads back onto the same modules with every tensor, in the engine's own load
paths (`engine.models.lora.keep_lora_targets`). PEFT's rewrite of such targets into the experts'
parameters, and its notice that the patterns it added matched nothing, do not reach a run."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import LoraConfig
from engine.models.arch import TINY_BASE
from engine.models.loading import quiet_third_party
from engine.models.lora import attach_lora, keep_lora_targets
from tests.engine.models.test_more_families import FAMILIES as MORE_FAMILIES

# model_type -> tiny config beyond TINY_BASE: each has shared experts or dense layers named
# gate_proj / up_proj / down_proj beside its fused experts.
FAMILIES = {
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1),
    "deepseek_v3": MORE_FAMILIES["deepseek_v3"],
    "glm4_moe": MORE_FAMILIES["glm4_moe"],
    "qwen3_next": MORE_FAMILIES["qwen3_next"],
}


def _model(model_type):
    try:
        cfg = AutoConfig.for_model(model_type, **{**TINY_BASE, **FAMILIES[model_type]})
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _no_pattern_notice(seen):
    return not [w for w in seen if "pattern keys did not match" in str(w.message)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_dense_mlps_train_and_the_experts_stay_frozen(model_type, tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = attach_lora(_model(model_type), LoraConfig(r=4, alpha=8))
    assert _no_pattern_notice(seen), [str(w.message) for w in seen]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any(".experts." in n for n in trained), [n for n in trained if ".experts." in n]
    dense = [n for n in trained if n.rsplit(".lora_", 1)[0].endswith(("gate_proj", "up_proj", "down_proj"))]
    assert dense, trained  # the shared experts' / dense layers' MLPs
    assert model.peft_config["default"].target_parameters in (None, set(), [])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = model(input_ids=ids).logits

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party(), keep_lora_targets():  # how chat and export load an adapter
            loaded = PeftModel.from_pretrained(_model(model_type), str(tmp_path / "adapter"))
    assert _no_pattern_notice(seen), [str(w.message) for w in seen]
    got_names = sorted(n for n, _ in loaded.named_parameters() if "lora_" in n)
    assert got_names == sorted(n for n, _ in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)
