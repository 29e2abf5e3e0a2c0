"""The training form's words: the label a user reads for each RunConfig field (LABELS; the config
key itself is in the field's tooltip, for YAML files and the CLI) and its tooltip, what the field
does in a sentence or two (HELP)."""

SECTION_TITLES = {
    "training": "Training",
    "lora": "LoRA adapter",
    "data": "Data",
    "model": "Model loading",
    "fast_paths": "Fast paths",
    "output": "Output",
}

HELP = {
    "model.trust_remote_code": "Run Python code shipped with the model. Only for models you trust.",
    "model.allow_pickle": "Allow .bin/.pt weight files, which can run code when loaded. Prefer safetensors.",
    "model.dtype": "Precision of the base weights and compute. auto: bfloat16 where the GPU supports it.",
    "model.load_in_4bit": "QLoRA: keep base weights in 4-bit NF4 to save memory. auto: on when 16-bit would not fit.",
    "lora.r": "Rank of the adapter matrices. Higher learns more, costs more memory. 8–64 is typical.",
    "lora.alpha": "Scale of the adapter's update (alpha / r). Often equal to r or 2×r.",
    "lora.dropout": "Dropout on the adapter input, in [0, 1). 0 is fastest and usually fine.",
    "lora.target_modules": (
        "Which linear layers get adapters: all-linear, or a comma-separated list (q_proj, v_proj, ...)."
    ),
    "lora.init_adapter": (
        "Start the adapter from an earlier one: a PEFT adapter folder, or a run (its final adapter, else its "
        "latest checkpoint). Its rank and layers must match. E.g. GRPO or DPO after an SFT run: their reference "
        "stays the base without adapters; to measure from the SFT model (as TRL does), train on the SFT run's "
        "merged export instead."
    ),
    "data.split": "Which split of a Hub data set (or a data set folder) to train on.",
    "data.subset": (
        "The subset of a Hub data set or data set folder that has several (its configuration: 'main' of "
        "openai/gsm8k). Empty: its only one."
    ),
    "data.train_on_responses_only": "Mask prompt tokens so only the assistant's replies are learned.",
    "data.max_seq_len": "Tokens per packed row. Longer examples are truncated or dropped.",
    "data.overlong": "What to do with examples longer than max seq len: truncate them or drop them.",
    "data.max_examples": "Use only the first N examples (0 = all). Handy for a quick try.",
    "training.max_steps": "Optimizer steps to run; 0 derives the count from epochs.",
    "training.epochs": "Passes over the data set (used when max steps is 0).",
    "training.rows_per_micro_batch": "Packed rows per forward pass. auto: as many as fit in memory.",
    "training.grad_accum": "Micro-batches accumulated per optimizer step (a larger effective batch).",
    "training.lr": "Peak learning rate, e.g. 2e-4 for LoRA.",
    "training.weight_decay": "AdamW weight decay on the adapter weights.",
    "training.warmup_steps": "Steps of linear warm-up before the schedule starts.",
    "training.scheduler": "Learning-rate schedule after warm-up.",
    "training.max_grad_norm": "Clip gradients to this norm (0 turns clipping off).",
    "training.seed": "Random seed for shuffling and adapter initialisation.",
    "training.gradient_checkpointing": "Recompute activations in backward to save memory. auto: on when needed.",
    "training.offload": "Move checkpointed activations to CPU memory, hidden behind compute. auto: by VRAM.",
    "training.save_every": "Steps between checkpoints; 0 saves only at the end or on Stop.",
    "training.log_every": "Steps between metric reports.",
    "training.preflight": (
        "Before the first step, rehearse one step on the longest micro-batch to measure peak memory, step time "
        "and the ETA; if it runs out of memory, smaller settings are picked. auto: on a GPU."
    ),
    "training.spike_factor": (
        "A loss above this many times the recent median rolls the run back to its last good state with half "
        "the learning rate (NaN always does); a second time the run stops. 0: NaN only."
    ),
    "training.eval_every": (
        "Steps between eval losses on the held-out examples (the dashed curve on the Loss chart). auto: about "
        "10 per run; 0: never."
    ),
    "training.early_stopping_patience": (
        "Stop when this many evals in a row did not beat the best eval loss; the best checkpoint is kept and "
        "offered first on Chat and Export. 0: never stop early."
    ),
    "training.gallery_prompts": (
        "Prompts the model answers at every checkpoint (the Gallery tab on the Monitor page), one per line. "
        "Empty: up to gallery_size prompts of held-out examples."
    ),
    "training.gallery_size": "How many held-out examples the gallery takes when no prompts are typed; 0: no gallery.",
    "data.eval_fraction": (
        "Share of the examples held out for the eval loss (never trained on; chosen with the seed), at most "
        "200 and only for 200+ examples. 0: no held-out split."
    ),
    "data.eval_source": "A separate file of held-out examples for the eval loss, in the same format as the data.",
    "data.thinking": (
        "The chat template's thinking switch (its thinking / enable_thinking variable), the same in training, "
        "eval and the Chat page. on: DeepSeek-V3.2 and V4 render and train an answer's reasoning; off: Qwen3 "
        "opens its answers with an empty <think></think> and trains the answer only. auto: on when an answer "
        "carries its reasoning in a field (reasoning_content, reasoning, thinking), else the template's default."
    ),
    "output.tensorboard": (
        "Write loss, learning rate, memory and eval loss to <run>/tensorboard/ (pip install tensorboard)."
    ),
    "output.wandb": "Log to Weights & Biases (pip install wandb): offline in the run folder unless you are logged in.",
    "training.device": "Where to train. auto: the GPU when there is one, else the CPU (slow, for trying things).",
    "training.distributed": (
        "With several GPUs: ddp keeps the whole base on each GPU; fsdp shards a 16-bit base too big for one "
        "card across them (not a 4-bit base). auto: fsdp only when the 16-bit base does not fit one GPU."
    ),
    "fast_paths.kernels": "Triton kernels for RMSNorm, RoPE and gated MLP activations.",
    "fast_paths.add_rmsnorm": (
        "Add attention's output to the residual and normalize the sum in one kernel (needs the Triton kernels)."
    ),
    "fast_paths.qk_norm_rope": (
        "Qwen3, Gemma-3 and EXAONE-4 normalize each head of q and k before rotating them: do both in one "
        "kernel (needs the Triton kernels). Other families are not affected."
    ),
    "fast_paths.lora_autograd": "Fused LoRA MLP / QKV / O with a hand-written backward.",
    "fast_paths.stacked_bases": (
        "Keep the MLP's frozen gate and up weights side by side in memory, so each is multiplied in one "
        "GEMM with the other (same values, same memory; 16-bit bases)."
    ),
    "fast_paths.fold_lora": (
        "Multiply each LoRA projection of attention's q/k/v and the MLP's gate/up as one GEMM, its "
        "adapter's columns beside the frozen weight (same values; 16-bit bases, one GPU)."
    ),
    "fast_paths.fused_ce": "Cross-entropy fused with the LM head, never materialising the full logits.",
    "fast_paths.packed_attention": "Variable-length attention over packed documents (no padding).",
    "fast_paths.cached_metadata": "Build packing metadata once per batch instead of once per layer.",
    "fast_paths.moe_grouping": "Group tokens by expert in one pass for mixture-of-experts models.",
    "fast_paths.keep_attention": (
        "With offload and long documents: keep attention outputs so the recompute skips attention "
        "(uses memory when it fits)."
    ),
    "fast_paths.lean_recompute": (
        "With offload: recompute only what each layer's backward needs (no MLP output), so the "
        "backward's peak is lower and the step does fewer matmuls. Auto: on for models of hidden size "
        "4,096 and up (Qwen3-8B: faster and 0.9 GiB less); off for small ones, where the extra small "
        "kernels cost more time than they save."
    ),
    "fast_paths.host_embeddings": (
        "Keep the frozen embedding table in host memory, sending only each batch's rows to the GPU; "
        "a tied output head streams the table through the GPU once per micro-batch. auto: from the start "
        "for a 4-bit (QLoRA) model whose table is not tied to its head, otherwise when the card runs short."
    ),
    "fast_paths.tiled_mlp": (
        "Run each MLP over tiles of tokens, so long rows need far less memory (one more MLP forward "
        "per step). auto: when the card runs short."
    ),
    "fast_paths.nf4_matmul": (
        "QLoRA: read the 4-bit base inside each matmul instead of unpacking a full 16-bit copy of "
        "every weight first: a little less memory, much slower. auto: off (unpack, then multiply)."
    ),
    "fast_paths.cuda_graphs": (
        "Record each kind of training micro-batch once as a CUDA graph and replay it: one call instead "
        "of thousands of small launches, which is where small models spend their step. auto: on for "
        "models of hidden size below 4,096 when nothing in the run needs the host between kernels."
    ),
    "fast_paths.ce_chunk_tokens": "Tokens per chunk in the fused cross-entropy. auto: by vocabulary size.",
    "output.dir": "Folder where run folders are created.",
    "output.run_name": "Name of this run's folder; auto uses a timestamp.",
    "output.overwrite": "Replace an existing run folder of the same name.",
}

# Labels in words a user reads; a field not listed here is shown as its name with spaces.
LABELS = {
    "model.trust_remote_code": "run the model's own code",
    "model.allow_pickle": "allow pickle weights",
    "model.dtype": "precision",
    "model.load_in_4bit": "4-bit base (QLoRA)",
    "lora.r": "adapter rank",
    "lora.alpha": "adapter scale (alpha)",
    "lora.dropout": "adapter dropout",
    "lora.target_modules": "layers with adapters",
    "lora.init_adapter": "start from adapter",
    "data.split": "data set split",
    "data.subset": "data set subset",
    "data.train_on_responses_only": "train on answers only",
    "data.fold_system_message": "fold system message into first question",
    "data.earlier_reasoning": "earlier turns' reasoning",
    "data.thinking": "thinking",
    "data.max_seq_len": "tokens per row (max)",
    "data.overlong": "examples longer than a row",
    "data.max_examples": "use first N examples",
    "data.eval_fraction": "held-out share for eval",
    "data.eval_source": "held-out examples file",
    "training.max_steps": "steps (0: from epochs)",
    "training.epochs": "epochs",
    "training.rows_per_micro_batch": "rows per forward pass",
    "training.grad_accum": "gradient accumulation",
    "training.lr": "learning rate",
    "training.weight_decay": "weight decay",
    "training.max_grad_norm": "gradient clipping (max norm)",
    "training.gradient_checkpointing": "recompute activations (checkpointing)",
    "training.offload": "offload activations to RAM",
    "training.save_every": "checkpoint every N steps",
    "training.log_every": "report every N steps",
    "training.preflight": "rehearse the first step",
    "training.spike_factor": "loss spike rollback (x median)",
    "training.eval_every": "eval loss every N steps",
    "training.early_stopping_patience": "stop after N evals without a new best",
    "training.gallery_size": "gallery examples (no prompts typed)",
    "fast_paths.kernels": "Triton kernels",
    "fast_paths.add_rmsnorm": "fused residual add + norm",
    "fast_paths.qk_norm_rope": "fused q/k norm + RoPE",
    "fast_paths.lora_autograd": "fused LoRA layers",
    "fast_paths.stacked_bases": "gate/up in one GEMM",
    "fast_paths.fold_lora": "LoRA inside the base GEMM",
    "fast_paths.fused_ce": "fused loss (cross-entropy)",
    "fast_paths.packed_attention": "packed attention",
    "fast_paths.cached_metadata": "reuse packing metadata",
    "fast_paths.moe_grouping": "group MoE experts",
    "fast_paths.keep_attention": "keep attention outputs",
    "fast_paths.lean_recompute": "lean recompute (offload)",
    "fast_paths.host_embeddings": "embeddings in host memory",
    "fast_paths.tiled_mlp": "tiled MLP",
    "fast_paths.nf4_matmul": "4-bit matmul kernel",
    "fast_paths.cuda_graphs": "CUDA graphs",
    "fast_paths.ce_chunk_tokens": "tokens per loss chunk",
    "output.dir": "runs folder",
    "output.run_name": "run name",
    "output.overwrite": "replace a run of the same name",
    "output.tensorboard": "TensorBoard log",
    "output.wandb": "Weights & Biases log",
}


def label(path: str) -> str:
    """The form's label for the config field at `path`."""
    return LABELS.get(path) or path.rsplit(".", 1)[-1].replace("_", " ")
