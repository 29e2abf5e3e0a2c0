"""W5: one sparse MoE block's forward + backward (experts frozen, gradient to the input);
W9: HF + PEFT training the whole MoE model with a chosen experts implementation.

The baseline is transformers' own block with each experts implementation it registers
("eager" loops over experts; "grouped_mm" / "batched_mm" where this transformers has them).
Tokens/s here is block tokens per second, not a training step. Ours (bench.moe_block)
uses the same block, weights, inputs and step through `block_inputs` and `block_step`.
"""

from __future__ import annotations

import dataclasses

from bench.runner import Context, NotSupported, Prepared

MOE_ARCHES = ("qwen3_moe", "gpt_oss")


def available_experts_impls() -> list[str]:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except Exception:
        return ["eager"]
    names = ["eager"]
    for name in ("grouped_mm", "batched_mm"):
        try:
            if name in ALL_EXPERTS_FUNCTIONS:
                names.append(name)
        except Exception:
            pass
    return names


def block_dtype(ctx: Context):
    import torch

    return torch.bfloat16 if ctx.device.type == "cuda" else torch.float32


def block_inputs(ctx: Context, dtype) -> tuple[list, list]:
    """Hidden states and output gradients per step, seeded per step like the token batches.

    They are placed on the device before timing: a block step is a few milliseconds, and
    copying 2 x 64 MB from pageable host memory each step would take longer than the block.
    """
    import torch

    hidden = ctx.workload.config["hidden_size"]
    xs, gs = [], []
    for b in ctx.batches:
        g = torch.Generator().manual_seed(b.seed)
        xs.append(torch.randn(1, b.num_tokens, hidden, generator=g).to(dtype).to(ctx.device))
        gs.append(torch.randn(1, b.num_tokens, hidden, generator=g).to(dtype).to(ctx.device))
    return xs, gs


def block_step(block, xs, gs, device):
    def step(i):
        x = xs[i].detach().requires_grad_(True)
        out = block(x)
        if isinstance(out, tuple):  # GPT-OSS's block also returns router scores
            out = out[0]
        out.backward(gs[i])
        return None

    return step


def count_cuda_syncs(fn) -> int | None:
    """Device-to-host syncs `fn()` makes, counted by torch's sync debug mode (CUDA only)."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def setup_moe_block(experts_impl: str):
    def setup(ctx: Context) -> Prepared:
        from bench.workloads import build_moe_block

        wl = ctx.workload
        if experts_impl not in available_experts_impls():
            raise NotSupported(f"this transformers has no '{experts_impl}' experts implementation")
        dtype = block_dtype(ctx)
        block = build_moe_block(
            wl, dtype=dtype, device=ctx.device, experts_implementation=None if experts_impl == "eager" else experts_impl
        )
        if experts_impl == "eager":
            block.experts.config._experts_implementation = "eager"
        xs, gs = block_inputs(ctx, dtype)
        step = block_step(block, xs, gs, ctx.device)
        options = {"experts_implementation": experts_impl, "block": type(block).__name__}
        if ctx.device.type == "cuda":  # one extra untimed step, before the warm-ups
            options["cuda_syncs_per_step"] = count_cuda_syncs(lambda: step(0))
        return Prepared(step, options, keep=[block, xs, gs])

    return setup


def is_moe_model(wl) -> bool:
    """A whole-model training workload of a MoE architecture (W9), not a single block (W5)."""
    return wl.kind == "train" and wl.arch in MOE_ARCHES


def setup_hf_moe_model(experts_impl: str):
    """HF + PEFT (sdpa) training the whole MoE model with transformers' `experts_impl` experts."""

    def setup(ctx: Context) -> Prepared:
        from bench.peers.hf import setup_hf

        wl = ctx.workload
        if not is_moe_model(wl):
            raise NotSupported(f"{wl.id} is not a whole-model MoE workload (experts implementations apply to W9)")
        have = available_experts_impls()
        if experts_impl not in have:
            import transformers

            raise NotSupported(
                f"transformers {transformers.__version__} has no '{experts_impl}' experts implementation "
                f"(it has: {', '.join(have)})"
            )
        # The switch travels in the workload's extra: build_model sets it on the config, so the
        # stock setup (bench.peers.hf) builds, wraps and trains the model unchanged.
        built = dataclasses.replace(
            ctx, workload=wl.with_changes(extra=dict(wl.extra, experts_implementation=experts_impl))
        )
        prep = setup_hf("sdpa")(built)
        model = prep.keep[0]
        got = getattr(model.config, "_experts_implementation", None)
        if got != experts_impl:  # never record one implementation under another's name
            raise NotSupported(f"asked transformers for '{experts_impl}' experts, the model runs '{got}'")
        prep.options["experts_implementation"] = got
        return prep

    return setup
