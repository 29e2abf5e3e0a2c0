"""TRL's SFTTrainer + PEFT with padding-free packing: what users of the fine-tuning GUIs run.

The trainer is built the way a user builds it (`SFTConfig(packing=True, packing_strategy="bfd",
padding_free=True, gradient_checkpointing=True, bf16=...)`, optionally `use_liger_kernel=True`),
on the bench's model, with the bench's LoRA (peers.hf.peft_config) and its one AdamW passed in
as `optimizers=(opt, constant schedule)`. The harness needs a step per call, so instead of
`trainer.train()` each step runs what one iteration of Trainer's loop runs with gradient
accumulation 1: `trainer.training_step(model, inputs, num_items_in_batch)` (TRL's
compute_loss: the model's forward with TRL's fused LM head, its chunked log-prob loss, then
accelerate's backward), `optimizer.step()`, `lr_scheduler.step()`, `model.zero_grad()`. The
setup does what `train()` does before its loop: Liger on the model (transformers'
apply_liger_kernel with the config TRL set), gradient checkpointing, and
`accelerator.prepare(model, optimizer)` (bf16 autocast on a GPU, as SFTConfig's bf16=True
default gives). Logging, callbacks and grad-norm bookkeeping of the loop are left out; gradient
clipping is off (max_grad_norm=0) so the updates are the bench's AdamW and nothing else.

Data: the bench's documents as pre-tokenized ids (the same ids every implementation trains on;
TRL skips its tokenizer for an `input_ids` column). Each step's documents are packed by TRL's
own `trl.data_utils.pack_dataset(..., strategy="bfd")` into one row (a step's documents fill
exactly one `max_length` row, so the row holds the same tokens as everyone's step; BFD orders
them longest first), and TRL's padding-free collator turns that row into the batch: position_ids
restarting at each document, -100 labels at each document start (the same trained targets as the
other peers), and the flash-attention kwargs (cu_seq_lens_q, max_length_q). Collation is host
work a data loader does ahead of the GPU: it is done at setup, as the other peers build inputs
before timing.
"""

from __future__ import annotations

import tempfile

from bench.runner import Context, NotSupported, Prepared, make_peer_optimizer


def _tiny_tokenizer():
    """A tokenizer object for SFTTrainer's processing_class: it only supplies the pad token.

    The documents are already token ids, the collator pads nothing (one full row), so no real
    vocabulary is needed and nothing is read from disk or downloaded.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def packed_rows(batches, max_length: int):
    """One TRL-packed row per step: pack_dataset(bfd) over that step's documents alone."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    rows = []
    for b in batches:
        docs = b.documents()
        packed = pack_dataset(Dataset.from_dict({"input_ids": docs, "labels": docs}), max_length, "bfd")
        if len(packed) != 1:  # the step's tokens are exactly one row: BFD must not split them
            raise RuntimeError(f"TRL packed one step into {len(packed)} rows, not 1")
        rows.append(packed[0])
    return rows


def _apply_liger(trainer) -> dict:
    """What Trainer.train() does first with use_liger_kernel=True (TRL set its config)."""
    config = dict(trainer.args.liger_kernel_config or {})
    try:
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError:  # an older transformers does it inline in train()
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from transformers.trainer_utils import unwrap_peft_model

        _apply_liger_kernel_to_instance(model=unwrap_peft_model(trainer.model), **config)
    else:
        apply_liger_kernel(trainer.model, config)
    return config


def setup_trl(attn: str, liger: bool = False):
    """attn: "sdpa", "flex_attention" or "varlen" (bench.peers.varlen); liger: use_liger_kernel=True."""

    def setup(ctx: Context) -> Prepared:
        import torch
        from peft import get_peft_model

        from bench.peers.hf import peft_config
        from bench.workloads import build_model

        wl = ctx.workload
        cuda = ctx.device.type == "cuda"
        if liger and not cuda:
            raise NotSupported("Liger's Triton kernels need a CUDA GPU")
        if attn == "varlen":
            from bench.peers import varlen

            why = varlen.unavailable(ctx.device)
            if why:
                raise NotSupported(why)
        if attn == "flex_attention" and not cuda:
            raise NotSupported("torch's flex_attention has no backward on the CPU")
        if wl.quant == "nf4":
            from bench.ours import _need_bnb

            _need_bnb(ctx.device)
        try:
            import trl
            from trl import SFTConfig, SFTTrainer
        except Exception as exc:
            raise NotSupported(f"trl does not import ({type(exc).__name__}: {exc})") from None
        if liger:  # fail on a missing package before building a big model
            try:
                import liger_kernel.transformers  # noqa: F401
            except Exception as exc:
                raise NotSupported(f"liger_kernel does not import ({type(exc).__name__}: {exc})") from None

        options: dict = {"trainer": f"trl.SFTTrainer {trl.__version__}", "attn_implementation": attn}
        if attn == "varlen":
            options.update(attn_implementation=varlen.register(), **varlen.signature_note())
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_model(wl, dtype=dtype, device=ctx.device, attn_implementation=options["attn_implementation"])
        # What train() would switch on from SFTConfig(gradient_checkpointing=True), done here as
        # the HF peer does it: HF's own non-reentrant checkpointing on every layer.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The LoRA is attached here, not by SFTTrainer(peft_config=...), because the one AdamW must
        # be built over the LoRA parameters before the trainer takes it (optimizers=...). Same
        # call and config as the HF peer, so the LoRA starts from the same weights.
        model = get_peft_model(model, peft_config(wl))
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], ctx.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # constant, as every implementation

        out_dir = tempfile.TemporaryDirectory(prefix="bench-trl-")  # nothing is saved; removed with the peer
        rows = packed_rows(ctx.batches, wl.tokens)
        from datasets import Dataset

        args = SFTConfig(
            output_dir=out_dir.name,
            max_steps=len(ctx.batches),
            per_device_train_batch_size=1,
            gradient_accumulation_steps=1,
            learning_rate=ctx.lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            max_length=wl.tokens,
            dataset_kwargs={"skip_prepare_dataset": True},  # rows are packed above, per step
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            bf16=cuda,
            use_liger_kernel=liger,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=_tiny_tokenizer(),
            optimizers=(opt, sched),
        )
        if liger:
            options["liger"] = _apply_liger(trainer)
        model_p, opt_p = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped, trainer.optimizer = model_p, opt_p
        trainer.current_gradient_accumulation_steps = 1  # what the loop sets for one micro-batch per step

        # The collator's batches and the loop's token counts, made ahead of timing.
        batches, items = [], []
        for row in rows:
            batch = trainer.data_collator([row])
            _, n = trainer.get_batch_samples(iter([batch]), 1, trainer.args.device)
            batches.append(batch)
            items.append(n)
        tokens = [int(b["input_ids"].numel()) for b in batches]
        trained = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
        want = [b.num_tokens for b in ctx.batches]
        if tokens != want:  # padding or truncation would make the speeds incomparable
            raise RuntimeError(f"TRL's batches hold {tokens} tokens, the bench's steps {want}")

        def step(i):
            loss = trainer.training_step(model_p, dict(batches[i]), items[i])
            opt_p.step()
            sched.step()
            model_p.zero_grad()
            return loss.detach()

        b0 = batches[0]
        options.update(
            attn_implementation_used=model.config._attn_implementation,
            packing=True,
            packing_strategy=args.packing_strategy,
            padding_free=bool(trainer.padding_free),
            data="pre-tokenized ids; each step's documents packed by trl.data_utils.pack_dataset (bfd) into one row",
            collator=type(trainer.data_collator).__name__,
            collator_keys=sorted(b0),
            loss="TRL compute_loss: fused LM head, chunked log-probs (trl.trainer.utils.add_fused_lm_head)",
            mixed_precision=str(trainer.accelerator.mixed_precision),
            gradient_checkpointing="HF non-reentrant, every layer",
            max_grad_norm=args.max_grad_norm,
            lr_scheduler="constant",
            use_liger_kernel=liger,
            # TRL casts a quantized model's adapters to bf16 (QLoRA paper); the record says what ran.
            adapter_dtype=str(next(p.dtype for p in model.parameters() if p.requires_grad)).removeprefix("torch."),
            lora_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
        extra = {"tokens_per_step": tokens, "trained_tokens_per_step": trained}
        return Prepared(step, options, extra, keep=[trainer, model_p, opt_p, model, opt, batches, out_dir])

    return setup
