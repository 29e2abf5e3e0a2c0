"""Preference training and GRPO on a CUDA GPU: the per-token log-prob kernel at real shapes
(16,384 tokens, Qwen3's 151,936 vocabulary) against the full-logits reference, without the logits
materialised; and each method trains the demo model through the session on the GPU, with the
Triton log-prob kernel counted and no "adapters disabled" fallback in the reference pass. (The
parity suites against TRL run on the CPU: tests/engine/train/test_preference_parity.py and
test_grpo_parity.py.)

Run on the GPU host:  python -m pytest -m gpu tests/gpu/test_preference_gpu.py -q -s
"""

import contextlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from engine.kernels.token_logp import fused_linear_token_logp, fused_linear_token_logp_reference  # noqa: E402

TOKENS = 16384


@contextlib.contextmanager
def _peak_extra():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = {}
    yield out
    torch.cuda.synchronize()
    out["bytes"] = torch.cuda.max_memory_allocated() - base


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("hidden_size,vocab", [(1024, 151936), (4096, 151936)])
def test_token_logp_at_real_shapes(hidden_size, vocab, dtype, tol):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, hidden_size, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) / hidden_size**0.5 * 2).to(dtype)
    targets = torch.randint(0, vocab, (TOKENS,), device="cuda", generator=g)
    targets[torch.rand(TOKENS, device="cuda", generator=g) < 0.3] = -100
    row_w = torch.randn(TOKENS, device="cuda", generator=g)
    h = hidden.clone().requires_grad_()
    with _peak_extra() as peak:
        logp = fused_linear_token_logp(h, weight, targets)
        (logp * row_w).sum().backward()
    assert "TokenLogp" in type(logp.grad_fn).__name__
    assert peak["bytes"] < TOKENS * vocab * hidden.element_size() / 4, "logits materialized?"
    hr = hidden.clone().requires_grad_()
    ref = fused_linear_token_logp_reference(hr, weight, targets)
    (ref * row_w).sum().backward()
    assert _rel(logp, ref) < tol
    assert _rel(h.grad, hr.grad) < tol


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo", "kto", "grpo"])
def test_each_method_trains_a_tiny_qwen3_on_the_gpu(tmp_path, method):
    from engine.config import RewardConfig
    from tests.engine.train.test_methods_session import config, run, write_pairs, write_prompts, write_unpaired

    source = {"kto": write_unpaired, "grpo": write_prompts}.get(method, write_pairs)(tmp_path / "data.jsonl")
    cfg = config(tmp_path, method, source, steps=4)
    cfg.training.device = "cuda"
    if method == "grpo":
        cfg.grpo.group_size, cfg.grpo.max_new_tokens, cfg.grpo.beta = 4, 8, 0.04
        cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"Answer: [^\n]+")]
    _, steps = run(cfg)
    assert len(steps) == 4
    for s in steps:
        assert s.fast_path_calls.get("token_logp:triton", 0) > 0, s.fast_path_calls
        assert not any("adapters disabled" in k for k in s.fallbacks), s.fallbacks
