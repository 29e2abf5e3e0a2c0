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

`TrlPeer` is that trainer and its step; `setup_trl` times it on the bench's steps and
`single_document_step` gives the memory-capped search (W7, bench.memcap) the same trainer
stepping one document of the searched length per call (packed and collated the same way).
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


def pack_documents(steps: list[list[list[int]]], max_length: int) -> list[dict]:
    """One TRL-packed row per step: pack_dataset(bfd) over that step's documents alone."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    rows = []
    for docs in steps:
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


class TrlPeer:
    """The SFTTrainer of a peer, set up as `train()` sets it up before its loop, and its step.

    `steps` are the documents of each training row (packed here by `pack_documents` into the
    trainer's dataset, `self.rows`); `collate(row)` is the trainer's padding-free collator and
    the loop's token count; `step(batch, n)` is one iteration of the loop.
    """

    def __init__(self, wl, device, lr: float, attn: str, liger: bool, steps, max_length: int):
        import torch
        from peft import get_peft_model

        from bench.peers.hf import peft_config
        from bench.workloads import build_model

        cuda = device.type == "cuda"
        if liger and not cuda:
            raise NotSupported("Liger's Triton kernels need a CUDA GPU")
        options: dict = {"attn_implementation": attn}
        if attn == "varlen":  # NotSupported (and why) before importing TRL or building anything
            from bench.peers import varlen

            options.update(varlen.attn_options(device))
        if attn == "flex_attention" and not cuda:
            raise NotSupported("torch's flex_attention has no backward on the CPU")
        if wl.quant == "nf4":
            from bench.ours import _need_bnb

            _need_bnb(device)
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

        options["trainer"] = f"trl.SFTTrainer {trl.__version__}"
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_model(wl, dtype=dtype, device=device, attn_implementation=options["attn_implementation"])
        # What train() would switch on from SFTConfig(gradient_checkpointing=True), done here as
        # the HF peer does it: HF's own non-reentrant checkpointing on every layer.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The LoRA is attached here, not by SFTTrainer(peft_config=...), because the one AdamW must
        # be built over the LoRA parameters before the trainer takes it (optimizers=...). Same
        # call and config as the HF peer, so the LoRA starts from the same weights.
        model = get_peft_model(model, peft_config(wl))
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # constant, as every implementation

        self.out_dir = tempfile.TemporaryDirectory(prefix="bench-trl-")  # nothing is saved; removed with the peer
        self.rows = pack_documents(steps, max_length)
        from datasets import Dataset

        args = SFTConfig(
            output_dir=self.out_dir.name,
            max_steps=len(self.rows),
            per_device_train_batch_size=1,
            gradient_accumulation_steps=1,
            learning_rate=lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            max_length=max_length,
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
            train_dataset=Dataset.from_list(self.rows),
            processing_class=_tiny_tokenizer(),
            optimizers=(opt, sched),
        )
        if liger:
            options["liger"] = _apply_liger(trainer)
        model_p, opt_p = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped, trainer.optimizer = model_p, opt_p
        trainer.current_gradient_accumulation_steps = 1  # what the loop sets for one micro-batch per step
        self.trainer, self.args, self.model, self.model_p = trainer, args, model, model_p
        self.opt, self.opt_p, self.sched, self.options = opt, opt_p, sched, options

    def collate(self, row) -> tuple[dict, object]:
        """The collator's batch of one packed row and the loop's count of its trained tokens."""
        batch = self.trainer.data_collator([row])
        _, n = self.trainer.get_batch_samples(iter([batch]), 1, self.trainer.args.device)
        return batch, n

    def step(self, batch, num_items):
        """One iteration of Trainer's loop (gradient accumulation 1); returns the loss."""
        loss = self.trainer.training_step(self.model_p, dict(batch), num_items)
        self.opt_p.step()
        self.sched.step()
        self.model_p.zero_grad()
        return loss.detach()


def setup_trl(attn: str, liger: bool = False):
    """attn: "sdpa", "flex_attention" or "varlen" (bench.peers.varlen); liger: use_liger_kernel=True."""

    def setup(ctx: Context) -> Prepared:
        wl = ctx.workload
        peer = TrlPeer(wl, ctx.device, ctx.lr, attn, liger, [b.documents() for b in ctx.batches], wl.tokens)
        # The collator's batches and the loop's token counts, made ahead of timing.
        collated = [peer.collate(row) for row in peer.rows]
        batches = [b for b, _ in collated]
        tokens = [int(b["input_ids"].numel()) for b in batches]
        trained = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
        want = [b.num_tokens for b in ctx.batches]
        if tokens != want:  # padding or truncation would make the speeds incomparable
            raise RuntimeError(f"TRL's batches hold {tokens} tokens, the bench's steps {want}")

        def step(i):
            return peer.step(*collated[i])

        trainer, model, args = peer.trainer, peer.model, peer.args
        options = dict(peer.options)
        options.update(
            attn_implementation_used=model.config._attn_implementation,
            packing=True,
            packing_strategy=args.packing_strategy,
            padding_free=bool(trainer.padding_free),
            data="pre-tokenized ids; each step's documents packed by trl.data_utils.pack_dataset (bfd) into one row",
            collator=type(trainer.data_collator).__name__,
            collator_keys=sorted(batches[0]),
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
        return Prepared(step, options, extra, keep=[peer, collated])

    return setup


def single_document_step(wl, device, lr: float, attn: str, liger: bool, max_length: int):
    """(model, optimizer, step(ids)) for the memory-capped search (bench.memcap): the speed runs'
    trainer (TrlPeer, same SFTConfig, padding-free) stepping one document of any length up to
    `max_length` per call, packed by pack_dataset and collated by the trainer's collator as a
    speed step's row is. SFTTrainer insists on a train_dataset: it gets a two-token placeholder
    row (train() never runs; each call brings its own row)."""
    peer = TrlPeer(wl, device, lr, attn, liger, [[[0, 1]]], max_length)

    def step(ids: list[int]) -> None:
        (row,) = pack_documents([[list(ids)]], max_length)
        batch, n = peer.collate(row)
        if int(batch["input_ids"].numel()) != len(ids):  # padded or truncated: not the length searched
            raise RuntimeError(f"TRL's batch holds {int(batch['input_ids'].numel())} tokens, not {len(ids)}")
        peer.step(batch, n)

    return peer.model, peer.opt_p, step
