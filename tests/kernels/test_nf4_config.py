"""`fast_paths.nf4_matmul` reaches the fused LoRA groups: auto and false dequantize (the kernel was
3.5-18x slower on the H200), true asks for the NF4 matmul kernel, which on a CPU means the same
dequantize path with nothing counted as a fallback."""

import pytest
import torch

pytest.importorskip("bitsandbytes")

from bench.workloads import CPU_TINY, build_model, quantize_nf4  # noqa: E402
from engine.config import FastPathConfig, LoraConfig  # noqa: E402
from engine.counters import reset_counters, split_counts  # noqa: E402
from engine.fastpath import patching  # noqa: E402
from engine.models.lora import attach_lora  # noqa: E402
from engine.models.patches import apply_fast_paths  # noqa: E402

CPU = torch.device("cpu")


def qlora_model():
    model = build_model(CPU_TINY, dtype=torch.float32, device=CPU, attn_implementation="eager", seed=0)
    quantize_nf4(model, compute_dtype=torch.float32)
    model = attach_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.train()


def group_modes(model):
    modes = []
    for module in model.modules():
        patched = patching.installed(module)
        if patched is None:
            continue
        plan = patched.plan
        for name in ("groups", "qkv", "o"):
            groups = getattr(plan, name, None)
            for g in groups if isinstance(groups, tuple) else (groups,):
                if g is not None:
                    modes.append(g.nf4)
    return modes


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("value,mode", [("auto", "off"), (False, "off"), (True, "auto")])
def test_switch_reaches_every_group(value, mode):
    model = qlora_model()
    apply_fast_paths(model, FastPathConfig(nf4_matmul=value), CPU)
    modes = group_modes(model)
    assert len(modes) == 4 * CPU_TINY.config["num_hidden_layers"]  # q/k/v, o, gate/up, down per layer
    assert set(modes) == {mode}


def test_true_on_a_cpu_dequantizes_without_a_fallback():
    model = qlora_model()
    ids = torch.randint(0, CPU_TINY.config["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    apply_fast_paths(model, FastPathConfig(), CPU)
    ref = loss_and_grads(model, ids)
    apply_fast_paths(model, FastPathConfig(nf4_matmul=True), CPU)
    reset_counters()
    got = loss_and_grads(model, ids)
    calls, fallbacks = split_counts(reset_counters())
    assert calls.get("lora_linears") and not fallbacks
    assert "nf4_matmul:triton" not in calls
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(got[1][n], ref[1][n]) for n in ref[1])
