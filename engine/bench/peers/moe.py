"""W5: one sparse MoE block's forward + backward (experts frozen, gradient to the input).

The baseline is transformers' own block with each experts implementation it registers
("eager" loops over experts; "grouped_mm" / "batched_mm" where this transformers has them).
Tokens/s here is block tokens per second, not a training step.
"""

from __future__ import annotations

from engine.bench.runner import Context, NotSupported, Prepared


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


def setup_moe_block(experts_impl: str):
    def setup(ctx: Context) -> Prepared:
        import torch

        from engine.bench.workloads import build_moe_block

        wl = ctx.workload
        if experts_impl not in available_experts_impls():
            raise NotSupported(f"this transformers has no '{experts_impl}' experts implementation")
        dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
        block = build_moe_block(wl, dtype=dtype, device=ctx.device,
                                experts_implementation=None if experts_impl == "eager" else experts_impl)
        if experts_impl == "eager":
            block.experts.config._experts_implementation = "eager"
        hidden = wl.config["hidden_size"]
        xs, gs = [], []
        for b in ctx.batches:  # hidden states seeded per step like the token batches
            g = torch.Generator().manual_seed(b.seed)
            xs.append(torch.randn(1, b.num_tokens, hidden, generator=g).to(dtype))
            gs.append(torch.randn(1, b.num_tokens, hidden, generator=g).to(dtype))

        def step(i):
            x = xs[i].to(ctx.device).requires_grad_(True)
            out = block(x)
            if isinstance(out, tuple):  # GPT-OSS's block also returns router scores
                out = out[0]
            out.backward(gs[i].to(ctx.device))
            return None

        return Prepared(step, {"experts_implementation": experts_impl, "block": type(block).__name__},
                        keep=[block, xs, gs])

    return setup
