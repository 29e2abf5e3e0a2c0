"""TRL's GRPOTrainer + PEFT on W11, without vLLM: what a laptop user of the fine-tuning tools runs.

Built the way a user builds it (`GRPOConfig(num_generations=8, max_completion_length=256, beta=...)`,
TRL's defaults otherwise: gradient checkpointing on, bf16 on a GPU, loss "dapo", rewards scaled per
group, sampling at temperature 1 with no top-k or top-p), on the bench's model with the bench's
LoRA (peers.hf.peft_config), its one AdamW passed in as `optimizers=(opt, constant schedule)`, and
W11's reward functions (bench.grpo_bench: the engine's built-ins, wrapped in TRL's signature). The
reference is TRL's own for a PEFT model: the base with the adapter disabled.

As bench.peers.trl_dpo does, each step runs one iteration of Trainer's loop by hand:
`trainer.training_step` (TRL's `_prepare_inputs` samples the groups with transformers' `generate`
and a KV cache, scores them and computes the reference log-probs; then the clipped loss and its
backward), `optimizer.step()`, `lr_scheduler.step()`, `model.zero_grad()`. The step's input is what
TRL's RepeatSampler hands it: each prompt `num_generations` times, as a conversation (one user
turn), so TRL renders it through the same chat template as ours. The record's reward, spread, KL
and completion-length curves are TRL's own logged metrics of each step.
"""

from __future__ import annotations

import tempfile

from bench.runner import Context, NotSupported, Prepared, make_peer_optimizer


def trl_reward_funcs(wl) -> list:
    """W11's rewards in TRL's signature: f(prompts, completions, **columns) -> list of floats,
    each named as the engine logs it (TRL logs rewards/<__name__>/mean)."""
    from bench.grpo_bench import reward_configs
    from engine.train.rewards import build_rewards

    funcs = []
    for r in build_rewards(reward_configs(wl)):

        def f(prompts, completions, _fn=r.fn, **kw):
            out = []
            for p, c in zip(prompts, completions):
                p = p[-1]["content"] if isinstance(p, list) else p
                c = c[-1]["content"] if isinstance(c, list) else c
                out.append(float(_fn(p, c)))
            return out

        f.__name__ = r.name
        funcs.append(f)
    return funcs


class TrlGrpoPeer:
    def __init__(self, wl, device, lr: float, tok):
        import torch
        from peft import get_peft_model

        from bench.peers.hf import peft_config
        from bench.workloads import build_model

        cuda = device.type == "cuda"
        try:
            import trl
            from datasets import Dataset
            from trl import GRPOConfig, GRPOTrainer
        except Exception as exc:
            raise NotSupported(f"trl does not import ({type(exc).__name__}: {exc})") from None
        x = wl.extra
        n = int(x["prompts"]) * int(x["group"])
        options: dict = {"trainer": f"trl.GRPOTrainer {trl.__version__}", "attn_implementation": "sdpa"}
        model = build_model(wl, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
        model.config.use_cache = True  # as a loaded checkpoint has it (build_model turns it off for training)
        args = GRPOConfig(
            output_dir=(out := tempfile.TemporaryDirectory(prefix="bench-trl-grpo-")).name,
            max_steps=1,
            per_device_train_batch_size=n,
            gradient_accumulation_steps=1,
            num_generations=int(x["group"]),
            max_completion_length=int(x["max_new_tokens"]),
            beta=float(x["beta"]),
            temperature=1.0,
            learning_rate=lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            bf16=cuda,
            use_cpu=not cuda,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        self.out_dir = out
        if args.gradient_checkpointing:  # TRL's default; Trainer.train() would turn it on here
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        model = get_peft_model(model, peft_config(wl))
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        opt, options["optimizer"] = make_peer_optimizer([p for p in model.parameters() if p.requires_grad], lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        placeholder = Dataset.from_list([{"prompt": [{"role": "user", "content": "a"}]}])
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=trl_reward_funcs(wl),
            args=args,
            train_dataset=placeholder,
            processing_class=tok,
            optimizers=(opt, sched),
        )
        model_p, opt_p = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped, trainer.optimizer = model_p, opt_p
        trainer.current_gradient_accumulation_steps = 1
        model_p.train()
        options.update(
            gradient_checkpointing=bool(args.gradient_checkpointing),
            loss_type=args.loss_type,
            scale_rewards=str(args.scale_rewards),
            top_k=args.top_k,
            top_p=args.top_p,
            use_vllm=bool(args.use_vllm),
            mixed_precision=str(trainer.accelerator.mixed_precision),
        )
        self.trainer, self.model, self.model_p, self.opt_p, self.sched = trainer, model, model_p, opt_p, sched
        self.group = int(x["group"])
        self.options = options

    def inputs(self, texts: list[str]) -> list[dict]:
        """What TRL's RepeatSampler yields for a step: each prompt `group` times, in order."""
        return [{"prompt": [{"role": "user", "content": t}]} for t in texts for _ in range(self.group)]

    def step(self, inputs) -> tuple:
        loss = self.trainer.training_step(self.model_p, list(inputs), None)
        self.opt_p.step()
        self.sched.step()
        self.model_p.zero_grad()
        m = self.trainer._metrics["train"]  # TRL's logged metrics, one entry per step

        def last(key, default=0.0):
            return float(m[key][-1]) if m.get(key) else default

        return loss.detach(), {
            "reward": last("reward"),
            "reward_std": last("reward_std"),
            "kl": last("kl"),
            "completion_length": last("completions/mean_length"),
        }


def setup_trl_grpo():
    def setup(ctx: Context) -> Prepared:
        from bench.grpo_bench import describe_rewards, load_tokenizer, prompt_texts

        tok = load_tokenizer(ctx.args, ctx.workload)
        peer = TrlGrpoPeer(ctx.workload, ctx.device, ctx.lr, tok)
        batches = [peer.inputs(prompt_texts(b, tok)) for b in ctx.batches]
        options = dict(
            peer.options,
            method="grpo",
            rewards=describe_rewards(ctx.workload),
            generation="transformers generate (no vLLM), KV cache, TRL's unwrap_model_for_generation",
            reference="TRL: the base with the PEFT adapter disabled",
            tokenizer=tok.name_or_path,
            lora_params=sum(p.numel() for p in peer.model.parameters() if p.requires_grad),
        )
        extra: dict = {"reward_curve": [], "reward_std_curve": [], "kl_curve": [], "completion_length_curve": []}

        def step(i):
            loss, m = peer.step(batches[i])
            for key in ("reward", "reward_std", "kl", "completion_length"):
                extra[f"{key}_curve"].append(m[key])
            return loss

        return Prepared(step, options, extra, keep=[peer, batches])

    return setup
