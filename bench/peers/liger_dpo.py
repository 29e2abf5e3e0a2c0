"""HF + PEFT with Liger's fused DPO loss on varlen flash attention: W10's fastest stock recipe.

TRL 1.16's DPOTrainer neither packs pairs (its padding_free is off) nor takes Liger's fused DPO
loss any more (bench.peers.trl_dpo), so this peer puts the pieces together as a user would who
wants both: the bench's model built on torch's varlen flash attention (bench.peers.varlen), Liger's
RMSNorm, RoPE and SwiGLU kernels on it, the bench's LoRA, HF's non-reentrant checkpointing, and
`liger_kernel.chunked_loss.LigerFusedLinearDPOLoss` for the loss (the LM head and the DPO loss in
chunks: no [tokens, vocab] logits), with the reference hidden states from the same model with the
adapters disabled (no autograd).

A step's pairs go in as one packed row (all chosen documents, then all rejected: the order
Liger's loss reads, first half chosen), positions restarting per document and the boundaries as
the flash-attention kwargs built on the host. The decoder's hidden states are then gathered into
the padded [2 x pairs, longest, hidden] layout Liger's loss takes (its targets: each document's
next tokens where they are answer tokens, -100 elsewhere), once for the policy and once for the
reference. CUDA only: varlen_attn and Liger's kernels have no CPU path.
"""

from __future__ import annotations

import inspect

from bench.runner import Context, NotSupported, Prepared, make_peer_optimizer


def packed_pairs(step) -> dict:
    """Host tensors of a PairStep as one packed row (chosen documents, then rejected): input_ids
    and position_ids [1, T], the varlen kwargs, and index [2P, L] (each document's tokens' places
    in the row, 0 past its end), targets [2P, L] (the next token where it is an answer token,
    -100 elsewhere)."""
    import torch

    from bench.peers.varlen import varlen_kwargs

    docs = [(p, c) for p, c, _ in step.pairs] + [(p, r) for p, _, r in step.pairs]
    lengths = [len(p) + len(a) for p, a in docs]
    width = max(lengths)
    ids, pos = [], []
    index = torch.zeros(len(docs), width, dtype=torch.int64)
    targets = torch.full((len(docs), width), -100, dtype=torch.int64)
    start = 0
    for d, (p, a) in enumerate(docs):
        seq = list(p) + list(a)
        n = len(seq)
        ids += seq
        pos += range(n)
        index[d, :n] = torch.arange(start, start + n)
        for t in range(len(p) - 1, n - 1):  # position t predicts seq[t + 1], an answer token
            targets[d, t] = seq[t + 1]
        start += n
    return {
        "input_ids": torch.tensor(ids).unsqueeze(0),
        "position_ids": torch.tensor(pos).unsqueeze(0),
        "varlen": varlen_kwargs(lengths),
        "index": index,
        "targets": targets,
    }


def _dpo_loss_module(beta: float):
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    # Liger's constructor has grown over versions: pass what this one takes. Summed answer
    # log-probs (average_log_prob False) as DPO and TRL define them; no NLL term.
    wanted = dict(beta=beta, use_ref_model=True, compute_nll_loss=False, average_log_prob=False)
    params = inspect.signature(LigerFusedLinearDPOLoss.__init__).parameters
    kwargs = {k: v for k, v in wanted.items() if k in params}
    return LigerFusedLinearDPOLoss(**kwargs), kwargs


def setup_liger_dpo():
    def setup(ctx: Context) -> Prepared:
        import torch
        from peft import get_peft_model

        from bench.peers import varlen
        from bench.peers.hf import LIGER_FUNCS, peft_config
        from bench.workloads import build_model

        wl = ctx.workload
        if ctx.device.type != "cuda":
            raise NotSupported("Liger's fused DPO loss and varlen flash attention need a CUDA GPU")
        options = dict(varlen.attn_options(ctx.device))  # NotSupported with the reason
        try:
            import liger_kernel
            import liger_kernel.transformers as lk

            loss_mod, options["liger_dpo_loss"] = _dpo_loss_module(float(wl.extra["beta"]))
        except Exception as exc:
            raise NotSupported(f"liger_kernel's DPO loss does not import ({type(exc).__name__}: {exc})") from None
        options["liger_version"] = getattr(liger_kernel, "__version__", "?")
        model = build_model(
            wl, dtype=torch.bfloat16, device=ctx.device, attn_implementation=options["attn_implementation"]
        )
        name = LIGER_FUNCS[wl.arch]
        getattr(lk, name)(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
        )
        options["liger"] = f"{name}(rope, rms_norm, swiglu); the loss is LigerFusedLinearDPOLoss"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, peft_config(wl))
        model.train()
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], ctx.lr)
        base = model.get_base_model()
        decoder, head = base.model, base.lm_head
        host = [packed_pairs(b) for b in ctx.batches]

        def hidden(inp):
            out = decoder(
                input_ids=inp["input_ids"], position_ids=inp["position_ids"], use_cache=False, **inp["varlen"]
            )
            return out.last_hidden_state[0][inp["index"]]  # [2P, L, hidden]

        def step(i):
            inp = {k: v.to(ctx.device, non_blocking=True) if hasattr(v, "to") else v for k, v in host[i].items()}
            inp["varlen"] = {
                k: v.to(ctx.device, non_blocking=True) if hasattr(v, "to") else v for k, v in host[i]["varlen"].items()
            }
            with model.disable_adapter(), torch.no_grad():
                ref = hidden(inp)
            out = loss_mod(head.weight, hidden(inp), inp["targets"], ref_input=ref, ref_weight=head.weight)
            loss = out[0] if isinstance(out, tuple) else out  # newer Liger returns (loss, aux outputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        options.update(
            method="dpo",
            batch="one packed row: chosen documents then rejected, varlen kwargs; gathered to [2P, L] for the loss",
            reference="the same model with the adapters disabled (PEFT disable_adapter), no autograd",
            gradient_checkpointing="HF non-reentrant, every layer",
            lora_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
        return Prepared(step, options, keep=[model, opt, host, loss_mod])

    return setup
