"""W5 / W5b for ours: the same MoE block, weights, inputs and step as the HF baseline
(bench.peers.moe), with engine.fastpath.moe's grouped forward installed on it.

Variants: "all-on" (grouped forward, Triton activations on CUDA), "no-kernels" (grouped
forward, torch activations), "no-moe-grouping" (the stock forward with HF's eager experts).
The record's options say which expert-matmul path ran (grouped_mm or loop), how many host
syncs the routing made per block call (engine.counters, read through moe.reset_counters) and,
on CUDA, how many device-to-host syncs one whole forward + backward made (torch's sync debug
mode).
"""

from __future__ import annotations

from bench.runner import Context, Prepared


def setup_ours_moe_block(variant: str, fields: dict):
    def setup(ctx: Context) -> Prepared:
        from bench.peers.moe import block_dtype, block_inputs, block_step, count_cuda_syncs
        from bench.workloads import build_moe_block
        from engine.fastpath import moe

        wl = ctx.workload
        dtype = block_dtype(ctx)
        block = build_moe_block(wl, dtype=dtype, device=ctx.device, experts_implementation="eager")
        grouping = fields.get("moe_grouping", "auto")
        kernels = "torch" if fields.get("kernels") is False else "auto"
        # Offload (part of every variant's base) has nothing to offload in one block.
        options = {
            "variant": variant,
            "block": type(block).__name__,
            "ignored_fields": sorted(k for k in fields if k not in ("moe_grouping", "kernels", "offload")),
        }
        if grouping is False:
            options["moe_grouping"] = "off: disabled in variant (stock forward, eager experts)"
        else:
            moe.group_block(block, kernels=kernels)
            options["moe_grouping"] = "on"
            options["expert_matmuls"] = moe.matmul_path(block, dtype, ctx.device)
            options["activation_kernels"] = "triton" if (kernels == "auto" and ctx.device.type == "cuda") else "torch"
        xs, gs = block_inputs(ctx, dtype)
        step = block_step(block, xs, gs, ctx.device)

        # One untimed step (before the warm-ups) to count what the routing asked of the host.
        moe.reset_counters()
        if ctx.device.type == "cuda":
            options["cuda_syncs_per_step"] = count_cuda_syncs(lambda: step(0))
        else:
            step(0)
        counts = moe.reset_counters()
        if counts["moe_calls"]:
            options["routing_host_syncs_per_call"] = counts["host_syncs"] / counts["moe_calls"]
        return Prepared(step, options, keep=[block, xs, gs])

    return setup
