"""The reference pass of DPO, KTO and GRPO: the same model with its adapters off, on the fast
path. Disabling PEFT's adapters used to send every patched projection to the stock path; now the
fused LoRA Functions run with the LoRA term left out, give the base model's output exactly, and
leave the adapter-weight cache for the next pass with the adapters on."""

from __future__ import annotations

import torch

from engine.config import FastPathConfig
from engine.counters import reset_counters
from engine.models.patches import apply_fast_paths
from tests.engine.models.test_patches import packed_batch, tiny


def test_adapters_off_stays_on_the_fused_path_and_gives_the_base():
    model = tiny("qwen3")
    ids, pos = packed_batch()
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # stock PEFT: the base alone
        tuned = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert not torch.allclose(base, tuned, atol=1e-3)  # the adapters do change the output

    apply_fast_paths(model, FastPathConfig(), torch.device("cpu"))
    reset_counters()
    with torch.no_grad():
        with model.disable_adapter():
            got_base = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        counts = reset_counters()
        got_tuned = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with model.disable_adapter():
            again = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        after = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert counts["lora_linears"] == 2 * 2 and counts["lora_mlp"] == 2  # q/k/v and o, MLP, per layer
    assert not [k for k in counts if k.startswith("fallback:")], counts
    torch.testing.assert_close(got_base, base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_tuned, tuned, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, base, rtol=0, atol=0)
    torch.testing.assert_close(after, got_tuned, rtol=0, atol=0)


def test_adapters_off_gives_no_adapter_gradients_and_the_base_input_gradient():
    model = tiny("llama")
    ids, pos = packed_batch()
    apply_fast_paths(model, FastPathConfig(), torch.device("cpu"))
    emb = model.get_input_embeddings()
    x = emb(ids).detach().requires_grad_()
    with model.disable_adapter():
        model(inputs_embeds=x, position_ids=pos, use_cache=False).logits.square().mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" in n)
    assert x.grad is not None and x.grad.abs().sum() > 0
