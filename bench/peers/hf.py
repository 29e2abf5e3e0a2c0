"""HF + PEFT peers, optionally with Liger's kernels: the stock way people train LoRA today.

Packed rows go in as position_ids (transformers detects the packing from the restarts and
builds a block-diagonal mask, or a flex BlockMask); with attn "varlen" (bench.peers.varlen:
torch's varlen flash attention registered through AttentionInterface) no mask is built and the
document boundaries go in as the flash-attention kwargs (cu_seq_lens_q, max_length_q), built
once per step on the host as a flattening collator does. Labels are the input ids with -100 at each
document start, so HF's internal shift trains exactly the engine's targets. Gradient
checkpointing is HF's own, non-reentrant. The optimizer is the bench's one AdamW definition,
set up as transformers' Trainer does by default (runner.make_peer_optimizer).
"""

from __future__ import annotations

from bench.runner import Context, NotSupported, Prepared, make_peer_optimizer

LIGER_FUNCS = {
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
}


def peft_config(workload):
    from peft import LoraConfig

    return LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(workload.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_liger(model, arch: str) -> str:
    """Liger's rms_norm, rope, swiglu and fused linear cross-entropy on this model instance."""
    try:
        import liger_kernel.transformers as lk
    except Exception as exc:
        raise NotSupported(f"liger_kernel does not import ({type(exc).__name__}: {exc})") from None
    name = LIGER_FUNCS.get(arch)
    if name is None or not hasattr(lk, name):
        raise NotSupported(f"liger_kernel has no {name or 'patch for ' + arch}")
    getattr(lk, name)(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True, model=model
    )
    return name


def setup_hf(attn: str, liger: bool = False):
    def setup(ctx: Context) -> Prepared:
        import torch
        from peft import get_peft_model

        from bench.workloads import build_model

        wl = ctx.workload
        if liger and ctx.device.type != "cuda":
            raise NotSupported("Liger's Triton kernels need a CUDA GPU")
        if attn == "varlen":
            from bench.peers import varlen

            why = varlen.unavailable(ctx.device)
            if why:
                raise NotSupported(why)
        if wl.quant == "nf4":
            from bench.ours import _need_bnb

            _need_bnb(ctx.device)
        if liger:  # fail on a missing package before building a big model
            try:
                import liger_kernel.transformers  # noqa: F401
            except Exception as exc:
                raise NotSupported(f"liger_kernel does not import ({type(exc).__name__}: {exc})") from None
        dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
        options = {"attn_implementation": attn}
        if attn == "varlen":
            options.update(attn_implementation=varlen.register(), **varlen.signature_note())
        model = build_model(wl, dtype=dtype, device=ctx.device, attn_implementation=options["attn_implementation"])
        if liger:
            options["liger"] = apply_liger(model, wl.arch)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, peft_config(wl))
        model.train()
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], ctx.lr)
        inputs = [b.hf_inputs() for b in ctx.batches]
        if attn == "varlen":
            inputs = [dict(inp, **varlen.varlen_kwargs(b.lengths)) for inp, b in zip(inputs, ctx.batches)]

        def step(i):
            # Tensors go to the device; the longest-document ints of the varlen kwargs stay ints.
            inp = {k: v.to(ctx.device, non_blocking=True) if hasattr(v, "to") else v for k, v in inputs[i].items()}
            out = model(**inp, use_cache=False)
            loss = out.loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        options["lora_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return Prepared(step, options, keep=[model, opt, inputs])

    return setup
