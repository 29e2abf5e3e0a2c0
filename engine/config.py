"""Run configuration: typed dataclasses, YAML load/save, and validation with field paths.

A `RunConfig` is everything a run needs (model, LoRA, data, training, fast paths, output).
Fields whose value is ``"auto"`` are filled by the hardware defaults policy
(`engine.hardware.policy.apply_defaults`) and listed in `RunConfig.auto_fields`, so the CLI and the
window can say which values the engine chose.

Errors are `ConfigError`s whose message names the field path (``training.lr``) and, for
choices, the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

AUTO = "auto"

# Why training.distributed "fsdp" refuses model.load_in_4bit (one sentence; the window shows it):
# FSDP2 shards a parameter's storage, and a bitsandbytes 4-bit weight's packed bytes are useless
# without their quantization state, which FSDP2 does not shard or gather with them.
FSDP_4BIT_REFUSAL = (
    "a 4-bit base is not sharded across GPUs here: use DDP (training.distributed: ddp, when the 4-bit "
    "base fits one card) or a 16-bit base (model.load_in_4bit: false)"
)


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type, or out of range."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


@dataclass
class ModelConfig:
    # "demo" (bundled), a local Hugging Face folder, or a Hub id.
    name_or_path: str = "demo"
    # Never run code shipped with a model unless asked to.
    trust_remote_code: bool = False
    # Pickle weight files (.bin/.pt) can run code when loaded; refuse them unless asked.
    allow_pickle: bool = False
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # 4-bit NF4 base weights (QLoRA). "auto": on when the 16-bit model would not fit.
    load_in_4bit: Union[bool, Literal["auto"]] = "auto"


@dataclass
class LoraConfig:
    r: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    # "all-linear": every linear projection of the decoder (not the LM head).
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"
    # Start the adapters from a trained PEFT adapter instead of fresh ones: its folder, or a run
    # (its final adapter/, else its latest checkpoint's). Any method: e.g. GRPO after an SFT cold
    # start. Its r, alpha and target modules must be the ones above. "" = fresh adapters.
    # The reference of DPO's, KTO's and GRPO's KL stays the base with the adapters off, not this
    # starting point (TRL's DPO after SFT takes the SFT model): for that, train on a merged export
    # of the SFT run (model.name_or_path) with fresh adapters (docs/ARCHITECTURE.md).
    init_adapter: str = ""


@dataclass
class DataConfig:
    # "demo" (bundled), a local .json/.jsonl/.csv/.tsv/.parquet file, a data set folder (a Hub data set's
    # files as `huggingface-cli download --repo-type dataset` leaves them, or datasets' save_to_disk), or a
    # Hub data set id.
    source: str = "demo"
    split: str = "train"
    # A Hub data set's (or folder's) subset, the configuration datasets calls `name`: "main" of openai/gsm8k.
    # "" = the data set's only one.
    subset: str = ""
    format: Literal["auto", "instruction", "conversations", "text"] = "auto"
    # Column mapping, e.g. {"instruction": "question", "output": "answer"} or
    # {"messages": "dialog"}; empty means detect.
    columns: dict[str, str] = field(default_factory=dict)
    # Mask prompt tokens so only responses are trained.
    train_on_responses_only: bool = True
    # A chat template that rejects a system message (Gemma-2's): fold it into the first user turn
    # instead of dropping the row.
    fold_system_message: bool = False
    # A template that drops the <think> reasoning of earlier answers from the history (Qwen3,
    # DeepSeek-R1): "drop" trains those answers as the template renders them (without it),
    # "final_turn_only" trains only each conversation's last answer, "keep" makes one example per
    # answer so every answer is trained with its reasoning.
    earlier_reasoning: Literal["drop", "final_turn_only", "keep"] = "drop"
    # The chat template's thinking switch (its `thinking` / `enable_thinking` variable: DeepSeek-V3.2
    # and V4 render an answer's reasoning only with it on; Qwen3 with it off writes an empty
    # <think></think> into the prompt), the same in training, eval, the X-ray and the chat. "auto":
    # on when an answer of the data carries its reasoning in a field (reasoning_content, reasoning,
    # thinking), else the template's own default; the run records what it used.
    thinking: Union[bool, Literal["auto"]] = "auto"
    # Tokens per packed row; examples longer than this are truncated or dropped.
    max_seq_len: int = 512
    overlong: Literal["truncate", "drop"] = "truncate"
    # Limit the number of examples (0 = all), handy for a quick look at a big set.
    max_examples: int = 0
    # Held-out examples for the eval loss, drawn from the data with training.seed and never
    # trained on: this share of the examples, at most 200, and only when there are at least
    # 200 examples (a smaller set has none to spare). 0 turns the split off.
    eval_fraction: float = 0.05
    # A separate file of held-out examples (same format and columns as data.source); when set,
    # nothing is split off the training data. "" = none.
    eval_source: str = ""


@dataclass
class TrainingConfig:
    # What the run learns: the name of an objective registered in engine.train.objectives
    # ("sft": the next-token loss on trained tokens; "dpo", "orpo", "simpo", "kto", "grpo" as
    # they are registered). The registry checks the name when the run starts (a ConfigError
    # naming training.method and the known methods); the config cannot import it (a leaf).
    method: str = "sft"
    # Optimizer steps; 0 means derive from epochs.
    max_steps: int = 0
    epochs: float = 1.0
    # Packed rows per micro-batch (flattened into one token stream; no padding).
    rows_per_micro_batch: Union[int, Literal["auto"]] = "auto"
    grad_accum: int = 1
    lr: float = 2e-4
    weight_decay: float = 0.0
    # AdamW's implementation: "auto" is the fused kernel on CUDA (one launch for every adapter
    # tensor) and the default elsewhere; "adamw" is the stock foreach/for-loop one.
    optimizer: Literal["auto", "adamw_fused", "adamw"] = "auto"
    warmup_steps: int = 0
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = 1.0
    seed: int = 42
    gradient_checkpointing: Union[bool, Literal["auto"]] = "auto"
    # Offloaded checkpointing: park each checkpointed layer's input in host memory.
    # "double" reloads the next layer's input during the current layer's backward (one more
    # layer input on the device, hides the copies); "single" reloads on demand.
    offload: Literal["auto", "off", "single", "double"] = "auto"
    save_every: int = 0  # steps between checkpoints; 0 = only at the end / on stop
    log_every: int = 1
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # Several processes (torchrun, `tunesmith train --gpus N`): "ddp" keeps the whole base on
    # every GPU and all-reduces the adapter gradients; "fsdp" shards the frozen base and the
    # adapters across the GPUs (FSDP2, per decoder layer), for a 16-bit base that does not fit
    # one card (a 4-bit base is refused). "auto": fsdp when the 16-bit base is over one device's
    # memory budget, else ddp. One process ignores it.
    distributed: Literal["auto", "ddp", "fsdp"] = "auto"
    # Before the first step, rehearse one forward + backward on the longest micro-batch and
    # measure peak memory and step time; a rehearsal that runs out of memory picks smaller
    # settings. "auto": on CUDA only (on a CPU there is no memory limit to find).
    preflight: Literal["auto", "on", "off"] = "auto"
    # A loss above this many times the median of recent losses (after warm-up) is a spike:
    # the run rolls back to the last good state and halves the LR (NaN/inf always do); a
    # second time it stops. 0 turns spike detection off (NaN/inf are still caught).
    spike_factor: float = 3.0
    # Optimizer steps between eval losses on the held-out examples (see data.eval_fraction);
    # "auto": about 10 per run; 0: never.
    eval_every: Union[int, Literal["auto"]] = "auto"
    # Stop when this many evals in a row have not improved the best eval loss (a checkpoint
    # and the final adapter are written); 0: never stop early.
    early_stopping_patience: int = 0
    # Prompts the model answers (greedily, up to 64 new tokens) at every checkpoint, stored in
    # the run folder's gallery.jsonl; empty: up to gallery_size prompts of held-out examples.
    gallery_prompts: list[str] = field(default_factory=list)
    # How many held-out prompts the gallery takes when gallery_prompts is empty; 0: no gallery.
    gallery_size: int = 3


@dataclass
class FastPathConfig:
    """Switches for each fast path; "auto" means on where it applies (CUDA, supported arch)."""

    kernels: Union[bool, Literal["auto"]] = "auto"  # RMSNorm, RoPE, gated MLP activations
    # The residual add after attention fused with the norm after it (engine.kernels.add_rmsnorm):
    # one launch each way instead of two forward and three backward; needs kernels on.
    add_rmsnorm: Union[bool, Literal["auto"]] = "auto"
    # Per-head q/k norms (Qwen3, Gemma-3, EXAONE-4) fused with the RoPE rotation after them
    # (engine.kernels.qk_norm_rope): one pass over q and k each way instead of four forward and
    # two backward; needs kernels on. Families without such norms are not affected.
    qk_norm_rope: Union[bool, Literal["auto"]] = "auto"
    lora_autograd: Union[bool, Literal["auto"]] = "auto"  # fused LoRA MLP / QKV / O
    # With the fused LoRA MLP: the frozen gate and up weights moved into one buffer, so the
    # forward is one GEMM for both and the input gradient one GEMM (engine.fastpath.lora_group.
    # stack_bases); same values, same memory. Dense (16-bit) bases only.
    stacked_bases: Union[bool, Literal["auto"]] = "auto"
    # With the fused LoRA layers: q/k/v's and gate/up's rank products folded into their base GEMMs,
    # y = [x | xA^T][W | sB]^T, one GEMM per projection instead of two, from 1,024 rows of input
    # (engine.fastpath.lora_fold; the frozen weights move into buffers 16-48 columns wider, same
    # values). Dense (16-bit) bases, one process. auto: models up to hidden size 2,048 (wider
    # ones gained nothing on an H100); true: any width.
    fold_lora: Union[bool, Literal["auto"]] = "auto"
    fused_ce: Union[bool, Literal["auto"]] = "auto"  # fused linear cross-entropy
    packed_attention: Union[bool, Literal["auto"]] = "auto"  # varlen attention kernel
    cached_metadata: bool = True  # packing metadata built once per batch (False: per layer)
    moe_grouping: Union[bool, Literal["auto"]] = "auto"
    # With offload: keep attention outputs for the recompute when documents are long enough
    # for it to pay and there is room (engine.fastpath.offload.attention_keep_bytes).
    keep_attention: bool = True
    # With offload: the recompute of each layer makes only what its backward needs (no MLP
    # down projection, no layer output; gate/up remade a row tile at a time in the backward):
    # less memory at the backward's peak and fewer matmuls (engine.fastpath.recompute), for more
    # small launches. auto: on for models whose step is bound by compute, not launches
    # (hidden size >= engine.train.step.LEAN_RECOMPUTE_MIN_HIDDEN).
    lean_recompute: Union[bool, Literal["auto"]] = "auto"
    # The frozen embedding table in host memory (engine.fastpath.host_embed; a tied head
    # streams it, engine.fastpath.host_head): auto moves a 4-bit (QLoRA) base's untied table
    # from the start, and any other when the pre-flight or a step runs out of memory (untied
    # first: no speed cost; tied after the free changes: a copy of the table per micro-batch);
    # true from the start; false never.
    host_embeddings: Union[bool, Literal["auto"]] = "auto"
    # Dense MLPs over tiles of tokens (engine.fastpath.tiled_mlp): long rows' MLP intermediates
    # one tile at a time, for one more MLP forward. auto: when memory runs short at one row.
    tiled_mlp: Union[bool, Literal["auto"]] = "auto"
    # QLoRA: NF4 base weights decoded tile by tile inside the matmul (engine.kernels.nf4_matmul)
    # instead of dequantized whole before each one. true: on CUDA where the kernel applies (no
    # dense copy of a weight, but 3.5-18x slower per product on the H200); auto/false: dequantize.
    nf4_matmul: Union[bool, Literal["auto"]] = "auto"
    # SFT micro-batches replayed as CUDA graphs, one per token bucket (engine.train.step_graph):
    # one call instead of thousands of launches. auto: on CUDA for models whose step is bound by
    # launches (hidden size < engine.train.step_graph.AUTO_MAX_HIDDEN); never with offload,
    # several processes, a 4-bit base, MoE routing or dropout (the report says why).
    cuda_graphs: Union[bool, Literal["auto"]] = "auto"
    ce_chunk_tokens: Union[int, Literal["auto"]] = "auto"


@dataclass
class OutputConfig:
    # Runs live in <dir>/<run_name>; run_name "auto" is a timestamp.
    dir: str = "runs"
    run_name: str = "auto"
    overwrite: bool = False
    # Scalars (loss, LR, grad norm, tokens/s, memory, eval loss) into <run>/tensorboard/ for
    # TensorBoard; needs the `tensorboard` package (the run says so when it is missing).
    tensorboard: bool = False
    # Weights & Biases: offline (files under <run>/wandb) unless WANDB_MODE or WANDB_API_KEY say
    # otherwise; needs the `wandb` package. Logging never fails a run.
    wandb: bool = False


@dataclass
class PreferenceConfig:
    """DPO, ORPO, SimPO and KTO settings (engine.train.objectives; TRL's names and defaults)."""

    # The preference strength: DPO's and KTO's beta (how far from the reference), ORPO's lambda
    # on the odds-ratio term, SimPO's reward scale. "auto": 2.0 for simpo, 0.1 for the others.
    beta: Union[float, Literal["auto"]] = AUTO
    simpo_gamma: float = 0.5  # SimPO's target margin
    cpo_alpha: float = 0.0  # SimPO: weight of an NLL term on the chosen answer (CPO's; 0 = SimPO proper)
    desirable_weight: float = 1.0  # KTO: weight of desirable answers' losses
    undesirable_weight: float = 1.0  # KTO: weight of undesirable answers' losses


@dataclass
class RewardConfig:
    """One GRPO reward function; each is logged separately and their weighted sum is the reward."""

    # "regex": 1 when the completion matches `pattern` (re.fullmatch on the stripped text);
    # "exact": 1 when the completion (or the regex's first group, if `pattern` is set) equals
    # the row's `column`; "length": -(characters over `max_chars`) / max_chars; "python": the
    # user's `reward(prompt, completion, **row) -> float` from `file` (runs the user's code).
    kind: Literal["regex", "exact", "length", "python"] = "regex"
    pattern: str = ""
    column: str = ""
    max_chars: int = 200
    file: str = ""
    weight: float = 1.0


@dataclass
class GRPOConfig:
    """GRPO: groups sampled from the current policy, rewards, the clipped objective."""

    group_size: int = 8  # completions sampled per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0  # weight of the KL to the adapter-free base (0: no reference pass)
    epsilon: float = 0.2  # ratio clip below
    epsilon_high: float = 0.2  # ratio clip above (DAPO raises it)
    loss_type: Literal["grpo", "bnpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    rewards: list[RewardConfig] = field(default_factory=list)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fast_paths: FastPathConfig = field(default_factory=FastPathConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # Dotted paths of fields the hardware policy filled in (reported, not user input), and why.
    auto_fields: list[str] = field(default_factory=list)
    auto_reasons: dict[str, str] = field(default_factory=dict)

    # -- conversion -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "RunConfig":
        cfg = _build(cls, data or {}, "")
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError("", f"cannot read config file {path}: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise ConfigError(
                "", f"{path} line {line} is not UTF-8 text (byte 0x{raw[exc.start]:02x}): save the file as UTF-8"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{path} is not valid YAML: {_yaml_problem(exc)}") from None
        if data is None:
            raise ConfigError(
                "",
                f"{path} is empty: it holds no settings (only blank lines or comments); "
                "write at least one section, e.g. 'model:' or 'data:'",
            )
        if not isinstance(data, dict):
            raise ConfigError("", f"{path} must hold a mapping of sections, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(exc.path, f"{exc.args[0].split(': ', 1)[-1]} (in {path})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml(), encoding="utf-8")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def copy(self) -> "RunConfig":
        return RunConfig.from_dict(self.to_dict())

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def positive(path: str, value, allow_zero=False, allow_auto=False):
            if allow_auto and value == AUTO:
                return
            if value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(path, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")

        positive("lora.r", self.lora.r)
        positive("lora.alpha", self.lora.alpha)
        if not 0.0 <= self.lora.dropout < 1.0:
            raise ConfigError("lora.dropout", f"must be in [0, 1), got {self.lora.dropout}")
        if isinstance(self.lora.target_modules, list) and not self.lora.target_modules:
            raise ConfigError("lora.target_modules", "must name at least one module or be 'all-linear'")
        positive("data.max_seq_len", self.data.max_seq_len)
        if self.data.max_seq_len < 8:
            raise ConfigError("data.max_seq_len", f"must be at least 8 tokens, got {self.data.max_seq_len}")
        positive("data.max_examples", self.data.max_examples, allow_zero=True)
        t = self.training
        positive("training.max_steps", t.max_steps, allow_zero=True)
        positive("training.epochs", t.epochs)
        positive("training.rows_per_micro_batch", t.rows_per_micro_batch, allow_auto=True)
        positive("training.grad_accum", t.grad_accum)
        positive("training.lr", t.lr)
        positive("training.weight_decay", t.weight_decay, allow_zero=True)
        positive("training.warmup_steps", t.warmup_steps, allow_zero=True)
        positive("training.max_grad_norm", t.max_grad_norm, allow_zero=True)
        positive("training.save_every", t.save_every, allow_zero=True)
        positive("training.log_every", t.log_every)
        if not t.method.strip():
            raise ConfigError("training.method", "must name a training method, e.g. 'sft'")
        if t.spike_factor != 0 and t.spike_factor <= 1:
            raise ConfigError(
                "training.spike_factor", f"must be 0 (off) or above 1 (a multiple of the median), got {t.spike_factor}"
            )
        if not 0.0 <= self.data.eval_fraction < 0.5:
            raise ConfigError(
                "data.eval_fraction", f"must be in [0, 0.5) (0 = no held-out split), got {self.data.eval_fraction}"
            )
        positive("training.eval_every", t.eval_every, allow_zero=True, allow_auto=True)
        positive("training.early_stopping_patience", t.early_stopping_patience, allow_zero=True)
        positive("training.gallery_size", t.gallery_size, allow_zero=True)
        for i, prompt in enumerate(t.gallery_prompts):
            if not prompt.strip():
                raise ConfigError(f"training.gallery_prompts[{i}]", "must not be empty")
        if t.distributed == "fsdp" and self.model.load_in_4bit is True:
            raise ConfigError("training.distributed", FSDP_4BIT_REFUSAL)
        positive("fast_paths.ce_chunk_tokens", self.fast_paths.ce_chunk_tokens, allow_auto=True)
        if not self.model.name_or_path.strip():
            raise ConfigError("model.name_or_path", "must not be empty")
        if not self.data.source.strip():
            raise ConfigError("data.source", "must not be empty")
        self._validate_methods()

    def _validate_methods(self) -> None:
        g = self.grpo
        if g.group_size < 2:
            raise ConfigError("grpo.group_size", f"must be at least 2 (advantages compare a group), got {g.group_size}")
        if g.max_new_tokens < 1:
            raise ConfigError("grpo.max_new_tokens", f"must be > 0, got {g.max_new_tokens}")
        if g.temperature <= 0 or not 0 < g.top_p <= 1:
            raise ConfigError("grpo.temperature", "temperature must be > 0 and top_p in (0, 1]")
        if g.beta < 0 or g.epsilon < 0 or g.epsilon_high < 0:
            raise ConfigError("grpo.beta", "beta, epsilon and epsilon_high must be >= 0")
        if self.training.method.strip().lower() == "grpo" and not g.rewards:
            raise ConfigError(
                "grpo.rewards",
                "GRPO needs at least one reward function: e.g. {kind: exact, column: answer} (a column of the "
                "data), {kind: regex, pattern: ...} (a format), {kind: length, max_chars: ...} or {kind: python, "
                "file: my_reward.py}",
            )
        for i, r in enumerate(g.rewards):
            need = {"regex": "pattern", "exact": "column", "python": "file"}.get(r.kind)
            if need and not getattr(r, need).strip():
                raise ConfigError(f"grpo.rewards[{i}].{need}", f"a {r.kind} reward needs its {need}")
            if r.kind == "length" and r.max_chars < 1:
                raise ConfigError(f"grpo.rewards[{i}].max_chars", f"must be > 0, got {r.max_chars}")
        b = self.preference.beta
        if b != AUTO and b <= 0:
            raise ConfigError("preference.beta", f"must be > 0, got {b}")


# -- generic dataclass builder with type checks ------------------------------------------------


def _build(cls, data: Any, path: str):
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(names)}"
            raise ConfigError(sub, f"unknown field{hint}")
        kwargs[key] = _coerce(hints[key], value, sub)
    return cls(**kwargs)


def _coerce(tp, value, path):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(path, f"must be one of {allowed}, got {value!r}")
        return value
    if origin is Union:
        errors = []
        # Try literal members first, so "auto" is not mistaken for a string path etc.
        for option in sorted(args, key=lambda a: typing.get_origin(a) is not Literal):
            try:
                return _coerce(option, value, path)
            except ConfigError as exc:
                errors.append(exc.args[0].split(": ", 1)[-1])
        raise ConfigError(path, " or ".join(dict.fromkeys(errors)))
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {value!r}")
        if isinstance(value, str):  # YAML reads 2e-4 as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(path, f"expected a number, got {value!r}") from None
        if not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp}")  # pragma: no cover - programming error


def _yaml_problem(exc: Exception) -> str:
    """One sentence with the line and column, not PyYAML's multi-line dump of the text around it."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"
