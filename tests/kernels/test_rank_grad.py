"""LoRA's rank-wide gradients (dB, and dA transposed) through the token-split kernel (the interpreter
on a CPU; bf16 dots only on the GPU, see tests/gpu/test_kernels_gpu.py) against the GEMM it replaces:
several splits and a ragged last one, column slices of wider buffers, ranks below the dot's 16, and
no tokens at all."""

import pytest
import torch

from engine.kernels import rank_grad as L


@pytest.mark.parametrize(
    "tokens,out,rank,dtype",
    [
        (300, 96, 8, torch.float32),  # rank below 16, out below one block, a ragged last step
        (1000, 160, 16, torch.float16),  # two out blocks, the second ragged
        (129, 64, 24, torch.float32),  # rank padded to 32
    ],
)
def test_matches_the_gemm_on_column_slices(monkeypatch, tokens, out, rank, dtype):
    monkeypatch.setattr(L, "_TARGET_PROGRAMS", 6)  # several splits even at these sizes
    g = torch.Generator().manual_seed(tokens)
    wide_dy = torch.randn(tokens, out + 40, generator=g).to(dtype)
    wide_xa = torch.randn(tokens, 3 * rank, generator=g).to(dtype)
    dy, xa = wide_dy[:, 40:], wide_xa[:, rank : 2 * rank]
    splits, per = L._splits(tokens, -(-out // L.BLOCK_N), 6)
    assert splits > 1 and per % L.BLOCK_T == 0
    got = L.rank_grad_triton(dy, xa, 0.5, torch.float32)
    want = 0.5 * dy.double().t() @ xa.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * tokens**0.5)
    assert got.dtype == torch.float32 and got.shape == (out, rank)
    ref = L.rank_grad_reference(dy, xa, 0.5, torch.float32)
    assert ref.shape == got.shape


def test_output_dtype_and_no_tokens():
    dy = torch.zeros(0, 32)
    xa = torch.zeros(0, 16)
    got = L.rank_grad_triton(dy, xa, 2.0, torch.float16)
    assert got.dtype == torch.float16 and got.shape == (32, 16) and not got.any()


def test_mismatched_tokens_are_refused_by_name():
    with pytest.raises(ValueError, match="rank_grad"):
        L.rank_grad_triton(torch.zeros(5, 32), torch.zeros(4, 16), 1.0, torch.float32)


def test_off_cuda_the_dispatcher_runs_the_gemm():
    g = torch.Generator().manual_seed(0)
    dy, xa = torch.randn(50, 40, generator=g), torch.randn(50, 16, generator=g)
    torch.testing.assert_close(L.rank_grad(dy, xa, 3.0, torch.float32), 3.0 * dy.t() @ xa)


def test_transposed_is_the_contiguous_transpose():
    g = torch.Generator().manual_seed(3)
    x, grad = torch.randn(200, 72, generator=g), torch.randn(200, 16, generator=g)
    got = L.rank_grad_triton(x, grad, 1.0, torch.float32, transposed=True)
    assert got.shape == (16, 72) and got.is_contiguous()
    torch.testing.assert_close(got, grad.t() @ x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(L.rank_grad_reference(x, grad, 1.0, torch.float32, transposed=True), grad.t() @ x)


def test_the_switch_and_the_bench_variants(monkeypatch):
    # On unless TUNESMITH_RANK_GRAD=0; the bench's variants set the switch to the engine's default
    # where they say nothing about it, so `rank_grad=false` is the cuBLAS before.
    import os

    from bench.ours import ENV_FIELDS, set_env_fields

    for name, _ in ENV_FIELDS.values():  # restored after the test: set_env_fields writes os.environ
        monkeypatch.setenv(name, "0")
    monkeypatch.delenv("TUNESMITH_RANK_GRAD")
    assert L._enabled()
    set_env_fields({"rank_grad": False})
    assert not L._enabled()
    set_env_fields({})
    assert L._enabled()
    set_env_fields({"rank_grad": True, "attn_pack": False})
    assert L._enabled()
    assert os.environ["TUNESMITH_ATTN_PACK"] == "0" and os.environ["TUNESMITH_FOLD_BACKWARD"] == "1"
    set_env_fields({})
    assert os.environ["TUNESMITH_ATTN_PACK"] == "1"


def test_which_calls_the_kernel_takes(monkeypatch):
    # Which calls the kernel takes, as on a CUDA device: 16-bit, the same dtype, rank <= MAX_RANK.
    monkeypatch.setattr(L, "on_cuda", lambda *t: True)
    monkeypatch.setattr(L, "_triton_runs_on", lambda device: True)
    monkeypatch.delenv("TUNESMITH_RANK_GRAD", raising=False)
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert L._kernel_takes(a, torch.zeros(4, L.MAX_RANK, dtype=torch.bfloat16))
    assert not L._kernel_takes(a, torch.zeros(4, L.MAX_RANK + 1, dtype=torch.bfloat16))
    assert not L._kernel_takes(a, torch.zeros(4, 16, dtype=torch.float16))
    assert not L._kernel_takes(a.float(), torch.zeros(4, 16))
    monkeypatch.setenv("TUNESMITH_RANK_GRAD", "0")
    assert not L._kernel_takes(a, torch.zeros(4, 16, dtype=torch.bfloat16))
    # A card Triton does not compile for (or no Triton): cuBLAS, even with lora_autograd forced on.
    monkeypatch.delenv("TUNESMITH_RANK_GRAD")
    monkeypatch.setattr(L, "_triton_runs_on", lambda device: False)
    assert not L._kernel_takes(a, torch.zeros(4, 16, dtype=torch.bfloat16))


def test_a_card_short_of_shared_memory_gets_fewer_stages(monkeypatch):
    # Triton raises OutOfResources when it loads a kernel whose stages do not fit the card (before anything
    # runs); the launch retries with fewer and keeps the fitted count, so the next call goes straight to it.
    # The stand-in raises only that load-time error; the kernel that then runs is the real one.
    real = L._rank_grad_kernel
    seen = []

    class ShortCard:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["num_stages"])
                if kw["num_stages"] > 1:
                    raise L.OutOfResources(100_000, 65_536, "shared memory")
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(L, "_rank_grad_kernel", ShortCard())
    monkeypatch.setattr(L, "_STAGES", {})
    g = torch.Generator().manual_seed(5)
    dy, xa = torch.randn(100, 40, generator=g), torch.randn(100, 16, generator=g)
    for _ in range(2):
        got = L.rank_grad_triton(dy, xa, 2.0, torch.float32)
        torch.testing.assert_close(got, 2.0 * dy.t() @ xa, rtol=1e-4, atol=1e-4)
    assert seen == [3, 2, 1, 1]
