"""TRL's DPOTrainer + PEFT on W10: what a user of the fine-tuning tools runs for DPO.

Built the way a user builds it (`DPOConfig(beta=..., gradient_checkpointing=True, bf16=...)`,
optionally `use_liger_kernel=True`), on the bench's model with the bench's LoRA
(peers.hf.peft_config) and its one AdamW passed in as `optimizers=(opt, constant schedule)`. The
reference is TRL's own for a PEFT model without a ref_model: the base through a frozen copy of
the initial adapter. As bench.peers.trl_sft does, each step runs one iteration of Trainer's loop
(`trainer.training_step`, `optimizer.step()`, `lr_scheduler.step()`, `model.zero_grad()`) after
the setup `train()` does (Liger's layer kernels when asked, accelerate's prepare: bf16 autocast
on a GPU).

What TRL 1.16 runs here, and why the record says so: its DPOTrainer turns `padding_free` off
("temporarily unavailable after a refactor"), so the pairs go as one padded batch of 2 x pairs
rows (chosen rows, then rejected) on SDPA; its log-probs come from TRL's own fused LM head in
chunks (`add_fused_lm_head`), and `use_liger_kernel=True` applies Liger's layer kernels only
(TRL refuses Liger's fused linear cross-entropy, which would drop that head). Liger's fused DPO
loss on varlen flash attention is bench.peers.liger_dpo.

Data: each step's pairs as token ids, in TRL's tokenized form ({prompt_ids, chosen_ids,
rejected_ids}); the trainer's own collator pads them at setup (host work a data loader does
ahead of the GPU). The trainer is built on a one-row placeholder data set (train() never runs).
"""

from __future__ import annotations

import tempfile

from bench.runner import Context, NotSupported, Prepared, make_peer_optimizer


class TrlDpoPeer:
    def __init__(self, wl, device, lr: float, liger: bool):
        import torch
        from peft import get_peft_model

        from bench.peers.hf import peft_config
        from bench.peers.trl_sft import _apply_liger, _tiny_tokenizer
        from bench.workloads import build_model

        cuda = device.type == "cuda"
        if liger and not cuda:
            raise NotSupported("Liger's Triton kernels need a CUDA GPU")
        try:
            import trl
            from datasets import Dataset
            from trl import DPOConfig, DPOTrainer
        except Exception as exc:
            raise NotSupported(f"trl does not import ({type(exc).__name__}: {exc})") from None
        if liger:
            try:
                import liger_kernel.transformers  # noqa: F401
            except Exception as exc:
                raise NotSupported(f"liger_kernel does not import ({type(exc).__name__}: {exc})") from None
        options: dict = {"trainer": f"trl.DPOTrainer {trl.__version__}", "attn_implementation": "sdpa"}
        model = build_model(wl, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, peft_config(wl))
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        self.out_dir = tempfile.TemporaryDirectory(prefix="bench-trl-dpo-")
        args = DPOConfig(
            output_dir=self.out_dir.name,
            max_steps=1,
            per_device_train_batch_size=wl.extra["pairs"],
            gradient_accumulation_steps=1,
            learning_rate=lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            beta=float(wl.extra["beta"]),
            max_length=None,  # the pairs are built within the workload's 1,024 tokens: nothing cut
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            bf16=cuda,
            use_cpu=not cuda,
            use_liger_kernel=liger,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        placeholder = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=placeholder,
            processing_class=_tiny_tokenizer(),
            optimizers=(opt, sched),
        )
        if liger:
            options["liger"] = _apply_liger(trainer)
        model_p, opt_p = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped, trainer.optimizer = model_p, opt_p
        trainer.current_gradient_accumulation_steps = 1
        self.trainer, self.model, self.model_p, self.opt_p, self.sched = trainer, model, model_p, opt_p, sched
        self.options = options

    def collate(self, step) -> dict:
        """The trainer's collator over a PairStep: a padded batch of chosen rows then rejected rows."""
        return self.trainer.data_collator(
            [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in step.pairs]
        )

    def step(self, batch):
        loss = self.trainer.training_step(self.model_p, dict(batch), None)
        self.opt_p.step()
        self.sched.step()
        self.model_p.zero_grad()
        return loss.detach()


def setup_trl_dpo(liger: bool = False):
    def setup(ctx: Context) -> Prepared:
        peer = TrlDpoPeer(ctx.workload, ctx.device, ctx.lr, liger)
        batches = [peer.collate(b) for b in ctx.batches]
        options = dict(
            peer.options,
            method="dpo",
            use_liger_kernel=liger,
            padding_free=bool(peer.trainer.padding_free),
            batch="padded: chosen rows then rejected rows (TRL's DataCollatorForPreference)",
            loss="TRL DPO sigmoid loss; log-probs through TRL's fused LM head (add_fused_lm_head)",
            reference="TRL: the base through a frozen copy of the initial adapter ('ref')",
            mixed_precision=str(peer.trainer.accelerator.mixed_precision),
            gradient_checkpointing="HF non-reentrant, every layer",
            lora_params=sum(p.numel() for p in peer.model.parameters() if p.requires_grad),
        )
        extra = {"padded_tokens_per_step": [int(b["input_ids"].numel()) for b in batches]}

        def step(i):
            return peer.step(batches[i])

        return Prepared(step, options, extra, keep=[peer, batches])

    return setup
