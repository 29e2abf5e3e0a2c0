"""The Tunesmith engine as a benchmark implementation, through the engine's own code path.

`attach_lora` -> `prepare_model` -> per step `PackedBatch.to(device)` + `forward_loss` +
backward + the engine's AdamW (engine.train.optim, fused on CUDA), exactly what the
TrainingSession runs. Variants switch single fast paths
off for ablations (`--ours-variants all-on,no-kernels,...` or `field=value+field=value`).
"""

from __future__ import annotations

import dataclasses
import time

from bench.runner import Context, NotSupported, NotYetSupported, Prepared, make_ours_optimizer

# "all-on" is the engine as a run on a GPU gets it under the WORKLOADS recipe (checkpointing
# on, so the hardware policy picks double-buffered offload); every variant is a change from it.
ALL_ON: dict = {"offload": "double"}
VARIANTS: dict[str, dict] = {
    "all-on": {},
    "no-kernels": {"kernels": False},
    "no-lora-autograd": {"lora_autograd": False},
    "no-fused-ce": {"fused_ce": False},
    "no-packed-attention": {"packed_attention": False},
    "rebuilt-metadata": {"cached_metadata": False},
    "all-off": {
        "kernels": False,
        "lora_autograd": False,
        "fused_ce": False,
        "packed_attention": False,
        "offload": "off",
    },
    "no-offload": {"offload": "off"},
    "offload-single": {"offload": "single"},
    "no-moe-grouping": {"moe_grouping": False},
    "no-keep-attention": {"keep_attention": False},
}


def _parse_value(v: str):
    low = v.strip().lower()
    if low in ("true", "on", "1"):
        return True
    if low in ("false", "off", "0"):
        return False
    try:
        return int(v)
    except ValueError:
        return v


def variant_fields(variant: str) -> dict:
    """Settings of a named variant or of `field=value+field=value`, on top of ALL_ON."""
    if variant in VARIANTS:
        return dict(ALL_ON, **VARIANTS[variant])
    out = dict(ALL_ON)
    for part in variant.split("+"):
        if "=" not in part:
            raise SystemExit(
                f"unknown ours variant {variant!r}; known: {', '.join(VARIANTS)} or field=value[+field=value]"
            )
        k, v = part.split("=", 1)
        out[k.strip()] = _parse_value(v)
    return out


# Variant fields that are not FastPathConfig switches but training settings.
TRAINING_FIELDS = ("offload",)

# Variant fields that are the engine's before/after switches read from the environment (no setting
# of their own): every variant sets each one, to "1" where it asks for true, "0" for false, and to
# the engine's own default where it says nothing ({field: (variable, default)}).
ENV_FIELDS = {
    "fold_backward": ("TUNESMITH_FOLD_BACKWARD", True),
    "attn_pack": ("TUNESMITH_ATTN_PACK", True),
    "rank_grad": ("TUNESMITH_RANK_GRAD", True),
    "fused_delta": ("TUNESMITH_ATTN_FUSED_DELTA", True),
    "fold_rows": ("TUNESMITH_FOLD_ROWS", True),
    "recompute_tail": ("TUNESMITH_RECOMPUTE_TAIL", True),
    "passing_norm": ("TUNESMITH_PASSING_NORM", True),
}


def split_fields(fields: dict) -> tuple[dict, dict]:
    """(FastPathConfig fields, training fields such as offload) of a variant."""
    fast = {k: v for k, v in fields.items() if k not in TRAINING_FIELDS and k not in ENV_FIELDS}
    return fast, {k: v for k, v in fields.items() if k in TRAINING_FIELDS}


def set_env_fields(fields: dict) -> None:
    """Set the ENV_FIELDS switches for a variant about to run (read by the engine at each call)."""
    import os

    changed = False
    for field, (name, default) in ENV_FIELDS.items():
        value = "1" if fields.get(field, default) else "0"
        changed |= name == "TUNESMITH_ATTN_PACK" and os.environ.get(name, "1") != value
        os.environ[name] = value
    if changed:  # the attention autotuners' picks were made under the other packing
        from engine.kernels.varlen_attention import forget_tuning

        forget_tuning()


def fast_path_config(fields: dict):
    from engine.config import FastPathConfig

    fields, _ = split_fields(fields)
    known = {f.name for f in dataclasses.fields(FastPathConfig)}
    missing = [k for k in fields if k not in known]
    if missing:
        raise NotYetSupported(f"engine.config.FastPathConfig has no {', '.join(missing)} switch")
    return FastPathConfig(**fields)


def lora_config(workload):
    from engine.config import LoraConfig

    return LoraConfig(r=16, alpha=16.0, dropout=0.0, target_modules=list(workload.lora_targets))


def prepare_ours(model, workload, device, fields: dict, gradient_checkpointing: bool = True):
    """Attach LoRA and switch the fast paths on; returns (PreparedModel, fast path config): the
    PreparedModel holds the PEFT model, its offloader (or None) and the fast-path report.

    Offload is off unless `fields` asks for it (variant_fields of "all-on" does).
    """
    from engine.models.lora import attach_lora
    from engine.train.step import prepare_model

    fp = fast_path_config(fields)
    offload = split_fields(fields)[1].get("offload", "off")
    model = attach_lora(model, lora_config(workload))
    prepared = prepare_model(model, fp, device, gradient_checkpointing=gradient_checkpointing, offload=offload)
    model.train()
    return prepared, fp


def loss_fn(prepared, fp):
    """step(batch) -> scalar loss, with the switches prepare_model settled on (and its offloader)."""
    from engine.train.step import forward_loss

    model, offloader, report = prepared.model, prepared.offloader, prepared.report
    fused = report.get("fused_ce", "on" if fp.fused_ce is not False else "off") == "on"
    chunk = None if fp.ce_chunk_tokens == "auto" else fp.ce_chunk_tokens

    def run(batch, normalizer=None):
        return forward_loss(
            model,
            batch,
            normalizer=batch.num_trained_tokens if normalizer is None else normalizer,
            fused_ce=fused,
            cached_metadata=fp.cached_metadata,
            ce_chunk_tokens=chunk,
            offloader=offloader,
        )

    return run, fused


def setup_ours(variant: str):
    def setup(ctx: Context) -> Prepared:
        import torch

        from bench.workloads import build_model
        from engine.data.collate import PackedBatch

        wl = ctx.workload
        fields = variant_fields(variant)
        fast_path_config(fields)  # fail before building a big model
        set_env_fields(fields)
        if wl.kind == "moe_block":  # W5: one MoE block, not a training step
            from bench.moe_block import setup_ours_moe_block

            return setup_ours_moe_block(variant, fields)(ctx)
        if wl.kind in ("dpo", "grpo"):  # W10, W11: a training method's step (bench.ours_methods)
            from bench.ours_methods import setup_ours_method

            return setup_ours_method(variant, fields)(ctx)
        if wl.quant == "nf4":
            _need_bnb(ctx.device)
        model = build_model(
            wl,
            dtype=torch.bfloat16 if ctx.device.type == "cuda" else torch.float32,
            device=ctx.device,
            attn_implementation="sdpa",
        )
        prepared, fp = prepare_ours(model, wl, ctx.device, fields)
        model, offloader, report = prepared.model, prepared.offloader, dict(prepared.report)
        run, fused = loss_fn(prepared, fp)
        opt, opt_options = make_ours_optimizer(model, ctx.lr)

        # Collation is host work a data loader does ahead of the GPU; it is timed apart and
        # kept out of the step time, as the peers' inputs are also built before timing.
        t0 = time.perf_counter()
        packed = [PackedBatch.from_documents(b.documents()) for b in ctx.batches]
        collate_ms = 1e3 * (time.perf_counter() - t0) / max(1, len(packed))

        extra = {"collate_ms": round(collate_ms, 2)}
        graphs = step_graphs(prepared, fp, wl, ctx.device, run, report)

        def step(i):
            if graphs is not None:  # the session's way (engine.train.step_runner)
                loss = graphs.forward_backward(packed[i], packed[i].num_trained_tokens)
                extra["cuda_graphs"] = {"captures": graphs.captures, "replays": graphs.replays}
            else:
                batch = packed[i].to(ctx.device)
                loss = run(batch)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if offloader is not None:  # what the last step did: buffer mode, attention kept
                extra["offload_step"] = offloader.stats.note()
            return loss.detach()

        options = {
            "variant": variant,
            "fast_paths": dataclasses.asdict(fp),
            "fast_paths_report": report,
            "offload": split_fields(fields)[1].get("offload", "off"),
            "fused_ce": fused,
            "attn_build": "sdpa",
            "lora_params": _count_trainable(model),
            "optimizer": opt_options,
        }
        keep = [model, opt, packed] + ([_Closing(graphs)] if graphs is not None else [])
        return Prepared(step, options, extra, keep=keep)

    return setup


class _Closing:
    """Closes the StepGraphs when the runner drops what a measurement kept (Prepared.keep)."""

    def __init__(self, graphs):
        self.graphs = graphs

    def __del__(self):
        self.graphs.close()


def step_graphs(prepared, fp, workload, device, run, report: dict):
    """The StepGraphs the session would use for this workload (engine.train.step_graph), or None;
    the report's cuda_graphs line either way."""
    from engine.train.step import lean_under_graphs
    from engine.train.step_graph import StepGraphs, device_memory, graph_choice

    on, why = graph_choice(
        fp.cuda_graphs,
        device=device,
        objective="sft",
        distributed=False,
        prepared=prepared,
        model=prepared.model,
        lora_dropout=float(lora_config(workload).dropout),
        memory=device_memory(device),
    )
    report["cuda_graphs"] = f"{'on' if on else 'off'}: {why}"
    if not on:
        return None
    lean_under_graphs(prepared, fp.lean_recompute)
    report["lean_recompute"] = prepared.report["lean_recompute"]
    params = [p for p in prepared.model.parameters() if p.requires_grad]
    off = prepared.offloader
    return StepGraphs(run, params, device, version=lambda: None if off is None else off.host_generation)


def _count_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _need_bnb(device) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:
        raise NotSupported(f"bitsandbytes does not import ({type(exc).__name__}: {exc})") from None
    if device.type != "cuda":
        raise NotSupported("QLoRA (NF4) workloads need a CUDA GPU")
