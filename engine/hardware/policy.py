"""The defaults policy: fills a RunConfig's "auto" fields from a HardwareProfile.

One function per decision, each returning its value and the reason for it (a `Decision`):
`memory_budget` (what the run may fill: a note, no config field), `device_default`,
`dtype_default`, `ce_chunk_default`, `load_in_4bit_default`, `checkpointing_default`,
`rows_default`, `offload_default`, `distributed_default` (DDP or FSDP2 under torchrun),
`kernels_default` (kernels, lora_autograd and fused_ce
together), `packed_attention_default`, `moe_grouping_default`, then `machine_warnings` and
`fit_check`. Later decisions follow earlier ones, so they read the memory `Budget` of the settled
device and estimate with a `Sizer` that carries the settled CE chunk.

The kind of machine drives them through `KIND_RULES` (one row per kind): how much of the measured
free memory is left to others (a laptop's desktop and browser share its card), how large an
automatic micro-batch may grow, whether a model that crowds the card in 16 bits goes to 4 bits,
and when activations are offloaded (laptop and desktop: always with checkpointing; datacenter:
only when the step does not fit without it; unified memory: never, the "host" is the same memory).
Within those rules the micro-batch grows until engine.models.estimate says the budget is full: the
estimate is pessimistic by design, so filling the budget with it leaves real headroom, and a
default that leaves most of a card unused wastes it.

`resolve_defaults(config, profile, model_info)` calls them in order and returns `Defaults`: the
filled copy of the config (each choice listed in `auto_fields`, its reason in `auto_reasons`)
with the notes, warnings, estimate and verdict beside it. `apply_defaults` is the filled config
alone; `explain_defaults(config)` lists its automatic values with their reasons, from the config
itself (so also for a run's reloaded config.yaml), and `Defaults.explain()` adds the notes and
warnings. `format_profile` is the text `tunesmith hw` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from engine.config import AUTO, RunConfig
from engine.hardware.profile import MIN_FAST_PATH_CAPABILITY, GiB, HardwareProfile, MiB
from engine.models import estimate as est

# Used to size the cross-entropy chunk when the model is not known yet: a large modern
# vocabulary (Qwen), so the chunk is never too big for the model that does get loaded.
DEFAULT_VOCAB = 151_936
# CPU runs plan against this fraction of the available RAM (the OS and the window need the rest).
CPU_PLAN_FRACTION = est.FIT_FRACTION
# Below this fraction of the budget, skipping checkpointing buys speed safely.
NO_CHECKPOINT_FRACTION = 0.5
# Fused cross-entropy chunk: chunk_tokens * vocab * 4 bytes stays under this share of the
# budget, and under an absolute cap (larger chunks stop getting faster).
CE_BUDGET_FRACTION = 0.04
CE_BUDGET_CAP = 1 * GiB
# Double-buffered offload needs one more layer's activations on the device (<= 0.5 GiB in the
# reference workloads); this is what it costs when the model is not known.
DOUBLE_BUFFER_EXTRA_UNKNOWN = 512 * MiB
# A micro-batch this large keeps a GPU's matmuls busy. On a consumer card a model whose 16-bit
# weights leave no room for one is trained in 4 bits (that is the size threshold: it moves with
# the card), and a datacenter step that fits one without offload skips the offload copies.
BUSY_TOKENS = 8_192
# Checkpointing is skipped when a micro-batch of this many tokens (or the kind's ceiling, if
# smaller) fits without it in half the budget; the rows then grow without it while they fit.
NO_CHECKPOINT_PROBE_TOKENS = 16_384
# Others' use of a consumer card above this share is worth a word (a game, a second run).
BUSY_CARD_FRACTION = 0.25

# A decided value and the reason for it, as shown to the user.
Decision = tuple[Any, str]


# -- what each kind of machine plans for -------------------------------------------------------


@dataclass(frozen=True)
class KindRules:
    """How one kind of machine turns its memory into defaults."""

    label: str  # for the reasons
    margin_fraction: float  # of the device's memory left to others, at least margin_min
    margin_min: int
    margin_for: str  # who the margin is left for
    max_tokens: int  # ceiling of an automatic micro-batch
    tokens_why: str
    prefer_4bit: bool  # 4 bits when 16 bits leave no room for a BUSY_TOKENS micro-batch
    offload: str  # "on": whenever checkpointing; "when_needed": only if the step does not fit; "never"


KIND_RULES: dict[str, KindRules] = {
    "rtx_laptop": KindRules(
        label="RTX laptop",
        margin_fraction=0.10,
        margin_min=768 * MiB,
        margin_for="the desktop and browser, which draw from the same card and grow during a run",
        max_tokens=32_768,
        tokens_why="conservative on a laptop: steps stay a few seconds long, so pause and stop answer quickly",
        prefer_4bit=True,
        offload="on",
    ),
    "rtx_desktop": KindRules(
        label="RTX desktop",
        margin_fraction=0.05,
        margin_min=384 * MiB,
        margin_for="a display and other programs that may use this card",
        max_tokens=32_768,
        tokens_why="as on a laptop: steps stay a few seconds long, so pause and stop answer quickly",
        prefer_4bit=True,
        offload="on",
    ),
    "datacenter": KindRules(
        label="datacenter GPU",
        margin_fraction=0.02,
        margin_min=256 * MiB,
        margin_for="other processes on the card (it drives no display)",
        max_tokens=65_536,
        tokens_why="a datacenter GPU needs large micro-batches to stay busy",
        prefer_4bit=False,
        offload="when_needed",
    ),
    "dgx_spark": KindRules(
        label="unified memory",
        margin_fraction=0.05,
        margin_min=4 * GiB,
        margin_for="the OS and the programs that share unified memory with the GPU",
        max_tokens=32_768,
        tokens_why="enough to keep a GB10-class GPU busy; its memory is plentiful but slower than VRAM",
        prefer_4bit=False,
        offload="never",
    ),
    "cpu": KindRules(
        label="CPU",
        margin_fraction=1 - CPU_PLAN_FRACTION,
        margin_min=0,
        margin_for="the OS and the window",
        max_tokens=0,  # CPU micro-batches follow micro_batch_target, not a ceiling
        tokens_why="CPU: small micro-batches keep steps short",
        prefer_4bit=False,
        offload="never",
    ),
}


# -- what the decisions share ------------------------------------------------------------------


@dataclass
class Defaults:
    """What `resolve_defaults` chose: the filled config and a reason for every choice."""

    config: RunConfig
    # Dotted config path -> (value, reason), for each field that was "auto".
    choices: dict[str, Decision] = field(default_factory=dict)
    # Values without a config field (e.g. memory.budget) -> (value, reason).
    notes: dict[str, Decision] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    model_info: est.ModelInfo | None = None
    estimate: int | None = None  # bytes for the chosen settings, when the model is known
    verdict: str | None = None

    def fill(self, path: str, decide: Callable[[], Decision]) -> None:
        """Set the config field at `path` from `decide()` when it is "auto"; a value the user
        set is kept and `decide` is not asked."""
        section, name = path.split(".")
        holder = getattr(self.config, section)
        if getattr(holder, name) != AUTO:
            return
        value, reason = decide()
        setattr(holder, name, value)
        self.choices[path] = (value, reason)
        if path not in self.config.auto_fields:
            self.config.auto_fields.append(path)
        # The reasons travel with the config (and into the run's config.yaml).
        self.config.auto_reasons[path] = reason

    def explain(self) -> list[str]:
        lines = [f"{path} = {_show(value)}: {reason}" for path, (value, reason) in self.choices.items()]
        lines += [
            f"{path} = {_show(value)} (no config field): {reason}" for path, (value, reason) in self.notes.items()
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return lines


@dataclass(frozen=True)
class Budget:
    """The memory a run plans against, once its device is settled."""

    on_gpu: bool
    memory: int  # bytes the run plans to fill: free memory less the kind's margin
    total: int  # bytes of the device (VRAM, unified memory or available RAM)
    free: int  # bytes free there now
    where: str  # "VRAM", "unified memory" or "RAM", for the reasons
    kind: str  # the KIND_RULES row that applies ("cpu" for a CPU run on any machine)

    @property
    def rules(self) -> KindRules:
        return KIND_RULES[self.kind]

    def __str__(self) -> str:
        return f"{_gib(self.memory)} {self.where} budget"


def memory_budget(device: str, profile: HardwareProfile) -> Decision:
    """The bytes a run may fill (a `Budget`) and why: measured free memory less what the kind
    leaves to others. Unified memory budgets against the OS's available figure, which counts the
    page cache it can reclaim (cudaMemGetInfo under-reports there)."""
    on_gpu = device == "cuda" and profile.has_gpu
    if not on_gpu:
        rules = KIND_RULES["cpu"]
        memory = int(CPU_PLAN_FRACTION * profile.ram_available)
        budget = Budget(False, memory, profile.ram_available, profile.ram_available, "RAM", "cpu")
        return budget, (
            f"{CPU_PLAN_FRACTION:.0%} of the {_gib(profile.ram_available)} of RAM available, "
            f"the rest left to {rules.margin_for}"
        )
    kind = profile.kind if profile.kind in KIND_RULES else "rtx_desktop"
    if profile.integrated_memory:
        kind = "dgx_spark"  # whatever the name says, shared memory is budgeted as shared
    rules = KIND_RULES[kind]
    margin = max(rules.margin_min, int(rules.margin_fraction * profile.total_vram))
    if profile.integrated_memory:
        free = min(profile.total_vram, profile.ram_available)
        measured = f"the OS reports {_gib(free)} available of {_gib(profile.total_vram)} unified memory"
        where = "unified memory"
    else:
        free = min(profile.total_vram, profile.free_vram)
        measured = f"{_gib(free)} of {_gib(profile.total_vram)} VRAM measured free"
        where = "VRAM"
    memory = max(0, free - margin)
    budget = Budget(True, memory, profile.total_vram, free, where, kind)
    return budget, f"{rules.label}: {measured}, less {_gib(margin)} left to {rules.margin_for}"


def budget_for(device: str, profile: HardwareProfile) -> Budget:
    return memory_budget(device, profile)[0]


@dataclass(frozen=True)
class Sizer:
    """The run's estimated peak memory for candidate settings (engine.models.estimate); only
    called when the model's shapes are known."""

    info: est.ModelInfo | None
    seq: int
    r: int
    ce_chunk_tokens: int
    shards: int = 1  # FSDP across this many processes: each device holds 1/shards of the base

    def __call__(self, mode: str, tokens: int, ckpt: bool, offload: str) -> int:
        parts = est.estimate_breakdown(
            self.info, self.seq, self.r, mode, tokens, ckpt, offload=offload, ce_chunk_tokens=self.ce_chunk_tokens
        )
        if self.shards <= 1:
            return parts.total
        # FSDP2: a device keeps its shard of the base and, while a layer runs, that layer
        # gathered whole, with the next one prefetched (two layers of 16-bit weights).
        layer = parts.weights / max(1, self.info.num_layers)
        return parts.total - parts.weights + int(parts.weights / self.shards + 2 * layer)


def training_mode(load_in_4bit: Any, dtype: str) -> str:
    """The estimate's name for how the base weights are held."""
    return "qlora4" if load_in_4bit is True else "lora32" if dtype == "float32" else "lora16"


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


def _cap(profile: HardwareProfile) -> str:
    c = profile.compute_capability
    return f"{c[0]}.{c[1]}" if c else "n/a"


# -- the decisions, in the order resolve_defaults takes them -----------------------------------


def device_default(profile: HardwareProfile) -> Decision:
    if profile.has_gpu:
        return "cuda", f"{profile.gpu_name} ({profile.kind})"
    return "cpu", profile.kind_reason


def machine_warnings(device: str, profile: HardwareProfile, budget: Budget) -> list[str]:
    """What the user should know about the device the run got."""
    if device == "cuda" and not profile.has_gpu:
        return [f"training.device is cuda but {profile.kind_reason}"]
    warnings = []
    if profile.gpu_count > 1 and budget.on_gpu:
        warnings.append(f"{profile.gpu_count} GPUs found; training uses one (cuda:0)")
    used = budget.total - budget.free
    if budget.on_gpu and budget.where == "VRAM" and used > BUSY_CARD_FRACTION * budget.total:
        warnings.append(
            f"other programs use {_gib(used)} of this card's {_gib(budget.total)}; "
            "closing them lets the run take a larger micro-batch"
        )
    return warnings


def dtype_default(profile: HardwareProfile, budget: Budget) -> Decision:
    if not budget.on_gpu:
        return "float32", "CPU: 16-bit matmuls are slow or missing on CPUs"
    if profile.bf16_supported:
        return "bfloat16", f"compute capability {_cap(profile)} supports bf16"
    return "float16", f"compute capability {_cap(profile)} has no bf16"


def ce_chunk_default(info: est.ModelInfo | None, budget: Budget) -> Decision:
    """Tokens per fused cross-entropy chunk. Sized before anything that is estimated, because
    every estimate includes it."""
    vocab = info.vocab_size if info else DEFAULT_VOCAB
    budget_bytes = min(CE_BUDGET_FRACTION * budget.memory, CE_BUDGET_CAP)
    chunk = max(128, min(8192, _pow2_floor(budget_bytes / (vocab * 4))))
    return chunk, (
        f"{chunk} x {vocab} vocab x 4 B = {chunk * vocab * 4 / MiB:.0f} MiB of fp32 logits per chunk, "
        f"within {CE_BUDGET_FRACTION:.0%} of the {budget}, capped at {_gib(CE_BUDGET_CAP)}"
    )


def load_in_4bit_default(profile: HardwareProfile, budget: Budget, size: Sizer) -> Decision:
    """4-bit base weights when 16 bits do not fit; on a consumer card also when they fit but
    crowd out the micro-batch (above that model size 4 bits train more tokens per step)."""
    if not budget.on_gpu:
        return False, "bitsandbytes 4-bit needs a CUDA GPU"
    if size.info is None:
        return False, "model size not known yet; 16-bit (set load_in_4bit: true for a model near the VRAM size)"
    seq, rules = size.seq, budget.rules
    lean = size("lora16", seq, True, "off" if profile.integrated_memory else "single")
    if lean > budget.memory:
        return True, f"16-bit LoRA needs ~{_gib(lean)} even at one {seq}-token row, over the {budget}"
    if rules.prefer_4bit:
        useful = max(seq, BUSY_TOKENS)
        room = size("lora16", useful, True, "double")
        if room > budget.memory:
            return True, (
                f"{rules.label}: in 16 bits this {_params(size.info)} model needs ~{_gib(room)} for a micro-batch "
                f"of {useful} tokens, over the {budget}; 4-bit weights leave the card to the micro-batch"
            )
        return False, (
            f"{rules.label}: in 16 bits a micro-batch of {useful} tokens needs ~{_gib(room)}, within the "
            f"{budget}; 16-bit trains faster than 4-bit"
        )
    return False, (
        f"16-bit LoRA at one {seq}-token row needs ~{_gib(lean)}, within the {budget} "
        f"({rules.label}: 4-bit only when 16-bit does not fit)"
    )


def load_in_4bit_for_fsdp() -> Decision:
    return False, "training.distributed is fsdp: the 16-bit base is sharded across the GPUs (4-bit cannot be)"


# A 16-bit base over this share of one device's budget leaves too little for the training
# itself (adapters, optimizer, activations, the loss): several processes shard it (FSDP2).
FSDP_WEIGHTS_SHARE = 0.8


def distributed_default(budget: Budget, info: est.ModelInfo | None, load_in_4bit: Any) -> Decision:
    """How several processes share the work (one process ignores it): DDP (the whole base on
    every device, adapter gradients all-reduced) unless the 16-bit base alone takes more than
    FSDP_WEIGHTS_SHARE of one device's budget, then FSDP2 (the base sharded per decoder layer).
    A 4-bit base stays DDP."""
    if load_in_4bit is True:
        return "ddp", "a 4-bit base is not sharded: each GPU holds it whole"
    if info is None:
        return "ddp", "model size not known yet: each GPU holds the whole base"
    weights = info.num_params * 2
    if weights > FSDP_WEIGHTS_SHARE * budget.memory:
        return "fsdp", (
            f"the 16-bit base of {_params(info)} parameters (~{_gib(weights)}) leaves too little of one device's "
            f"{budget} for training: FSDP2 shards it across the GPUs"
        )
    return "ddp", (
        f"the 16-bit base (~{_gib(weights)}) fits one device's {budget} with room to train: each GPU holds it, "
        "only the adapter gradients travel"
    )


def _params(info: est.ModelInfo) -> str:
    return f"{info.num_params / 1e9:.1f}B"


def _token_target(memory: int) -> int:
    """Tokens per micro-batch when the model's size is not known: what keeps a GPU of this size
    busy without crowding it."""
    gib = memory / GiB
    if gib >= 80:
        return 16_384
    if gib >= 40:
        return 8_192
    if gib >= 20:
        return 4_096
    if gib >= 12:
        return 2_048
    return 1_024


def micro_batch_target(rows: Any, seq: int, budget: Budget, info: est.ModelInfo | None, is_demo: bool) -> int:
    """Tokens per micro-batch before fitting them to memory: the user's rows when set; on a GPU
    the kind's ceiling (the micro-batch grows to it while the budget allows)."""
    if rows != AUTO:
        return rows * seq
    if budget.on_gpu:
        if info is None:
            return max(seq, min(budget.rules.max_tokens, _token_target(budget.total)))
        return max(seq, budget.rules.max_tokens)
    small = (info is None and is_demo) or (info is not None and info.num_params < 1e9)
    return 2 * seq if small and seq <= 512 else seq


def checkpointing_default(budget: Budget, size: Sizer, mode: str, target: int, is_demo: bool) -> Decision:
    if size.info is None:
        if budget.on_gpu or not is_demo:
            return True, "model size not known yet; checkpointing keeps activation memory small"
        return False, "CPU with the small bundled demo model: recomputing would only cost time"
    full = size(mode, target, False, "off")
    if full <= NO_CHECKPOINT_FRACTION * budget.memory:
        return False, (
            f"without it a {target}-token micro-batch needs ~{_gib(full)}, under "
            f"{NO_CHECKPOINT_FRACTION:.0%} of the {budget}: skip the recompute"
        )
    return True, (
        f"without it a {target}-token micro-batch needs ~{_gib(full)}, over "
        f"{NO_CHECKPOINT_FRACTION:.0%} of the {budget}"
    )


def offload_off_reason(profile: HardwareProfile, budget: Budget, ckpt: bool) -> str | None:
    """Why activation offload is off whatever the memory, or None when it depends on memory."""
    if not budget.on_gpu:
        return "CPU: activations already live in host memory"
    if profile.integrated_memory:
        return (
            "unified memory: the host and the GPU share it, so moving "
            "activations saves nothing (and no double buffering)"
        )
    if not ckpt:
        return "offload moves checkpointed activations; checkpointing is off"
    return None


def _busy_tokens(budget: Budget, seq: int) -> int:
    return max(seq, min(budget.rules.max_tokens, BUSY_TOKENS))


def planned_offload(
    profile: HardwareProfile, budget: Budget, ckpt: bool, size: Sizer | None = None, mode: str = ""
) -> str:
    """The offload the micro-batch is sized with, before `offload_default` settles it beside
    that micro-batch. A datacenter card sizes without offload when a busy micro-batch fits
    without it; the consumer kinds offload whenever they checkpoint."""
    if offload_off_reason(profile, budget, ckpt):
        return "off"
    if budget.rules.offload == "when_needed" and size is not None and size.info is not None:
        if size(mode, _busy_tokens(budget, size.seq), ckpt, "off") <= budget.memory:
            return "off"
    return "double"


def _most_rows(budget: Budget, size: Sizer, mode: str, ckpt: bool, offload: str, most: int) -> int:
    """The largest row count in [1, most] whose estimate fits the budget (1 if none does); the
    estimate grows with the tokens, so a bisection finds it."""
    lo, hi = 1, most
    if size(mode, hi * size.seq, ckpt, offload) <= budget.memory:
        return hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if size(mode, mid * size.seq, ckpt, offload) <= budget.memory:
            lo = mid
        else:
            hi = mid
    return lo


def rows_default(budget: Budget, size: Sizer, mode: str, target: int, ckpt: bool, offload: str) -> Decision:
    """Rows per micro-batch. On a GPU with a known model: as many as the budget holds, up to the
    kind's ceiling (filling the budget is what the estimate's pessimism is for); without the
    model: the size-based target; on a CPU: the target, halved until the estimate fits."""
    seq = size.seq
    rows = max(1, target // seq)
    if not budget.on_gpu:
        fits_note = ""
        if size.info is not None:
            while rows > 1 and size(mode, rows * seq, ckpt, offload) > budget.memory:
                rows //= 2
            fits_note = f", ~{_gib(size(mode, rows * seq, ckpt, offload))} estimated"
        return rows, f"{rows} x {seq} = {rows * seq} tokens per micro-batch; {budget.rules.tokens_why}{fits_note}"
    if size.info is None:
        return rows, (
            f"{rows} x {seq} = {rows * seq} tokens per micro-batch; ~{target} tokens suit "
            f"{_gib(budget.total)} {budget.where} (model size not known yet)"
        )
    rows = _most_rows(budget, size, mode, ckpt, offload, rows)
    tokens = rows * seq
    estimate = size(mode, tokens, ckpt, offload)
    head = f"{rows} x {seq} = {tokens} tokens per micro-batch, ~{_gib(estimate)} estimated"
    if estimate > budget.memory:
        return rows, f"{head}: even one row is over the {budget}"
    if rows * seq >= target:
        return rows, f"{head}: the {budget.rules.label} ceiling of {target} tokens ({budget.rules.tokens_why})"
    return rows, f"{head}: the most that fits the {budget} (offload {offload})"


def offload_default(
    profile: HardwareProfile, budget: Budget, size: Sizer, mode: str, tokens: int, ckpt: bool
) -> Decision:
    """Activation offload: off where it cannot help (CPU, unified memory, no checkpointing) and
    on a datacenter card when the micro-batch fits without it; else double-buffered when the
    budget leaves room for the second buffer, else single."""
    off = offload_off_reason(profile, budget, ckpt)
    if off:
        return "off", off
    rules = budget.rules
    if size.info is not None:
        if rules.offload == "when_needed":
            plain = size(mode, tokens, ckpt, "off")
            if plain <= budget.memory:
                return "off", (
                    f"{rules.label}: a {tokens}-token micro-batch fits without offload (~{_gib(plain)} in the "
                    f"{budget}): no copies to pay for"
                )
            why = f"{rules.label}: without offload a {tokens}-token micro-batch needs ~{_gib(plain)}, over the {budget}"
        else:
            why = f"{rules.label}: checkpointed activations go to host RAM, leaving the card to the micro-batch"
        double = size(mode, tokens, ckpt, "double")
        if double <= budget.memory:
            return "double", f"{why}; with the second buffer ~{_gib(double)} fits, and it hides the copies"
        return "single", (
            f"{why}; the second buffer would need ~{_gib(double)}, over the {budget}: "
            "one buffer, no room for the second"
        )
    # The run's own size is unknown: ask that the card be as free as a plan would leave it
    # (others' use of it is all that can be seen).
    need = int((1 - est.FIT_FRACTION) * profile.total_vram)
    headroom = budget.memory - need
    if headroom >= DOUBLE_BUFFER_EXTRA_UNKNOWN:
        return "double", (
            f"model size not known yet; the {budget} leaves {_gib(headroom)} beyond a typical run; "
            f"the second buffer needs ~{DOUBLE_BUFFER_EXTRA_UNKNOWN / MiB:.0f} MiB and hides the copies"
        )
    return "single", (
        f"model size not known yet; the {budget} leaves only {_gib(max(headroom, 0))} beyond a typical run: "
        "one buffer, no room for the second"
    )


def kernels_default(profile: HardwareProfile, budget: Budget) -> Decision:
    """Whether the Triton fast paths run: the value of kernels, lora_autograd and fused_ce."""
    if not budget.on_gpu:
        return False, "CPU: the plain-torch reference paths run (the Triton kernels need CUDA)"
    if not profile.triton_available:
        return False, "Triton is not installed: the plain-torch reference paths run"
    if profile.compute_capability and tuple(profile.compute_capability) < MIN_FAST_PATH_CAPABILITY:
        return False, (
            f"compute capability {_cap(profile)} is older than the Triton kernels support: "
            "the plain-torch reference paths run"
        )
    return True, "CUDA with Triton: the fused kernels apply"


def packed_attention_default(kernels_usable: bool) -> Decision:
    # It is also what keeps packed documents apart, so it is on everywhere: the Triton
    # varlen kernel where the fast paths run, per-document SDPA (the reference) elsewhere.
    return True, (
        "Triton varlen kernel"
        if kernels_usable
        else "per-document SDPA reference; documents never attend to each other"
    )


def moe_grouping_default() -> Decision:
    return True, (
        "plain torch (a stable sort by expert, group offsets by searchsorted, no host sync): helps on any device"
    )


def fit_check(
    size: Sizer, mode: str, tokens: int, ckpt: bool, offload: str, budget: Budget
) -> tuple[int, str, str | None]:
    """The estimate for the settled config, its verdict ("fits" within the budget, "tight" up to
    the whole device, else "will not fit"), and a warning unless it fits."""
    estimate = size(mode, tokens, ckpt, offload)
    if estimate <= budget.memory:
        return estimate, "fits", None
    verdict = "tight" if estimate <= budget.total else "will not fit"
    return (
        estimate,
        verdict,
        (
            f"{size.info.summary()}: ~{_gib(estimate)} estimated, over the {budget} "
            f"({_gib(budget.total)} {budget.where} in all): {verdict}"
            + ("; try a shorter data.max_seq_len or a smaller model" if verdict == "will not fit" else "")
        ),
    )


# -- the policy --------------------------------------------------------------------------------


def resolve_defaults(
    config: RunConfig, profile: HardwareProfile, model_info: est.ModelInfo | None = None, world_size: int = 1
) -> Defaults:
    """Fill every hardware-dependent "auto" field of a copy of `config`, with reasons.

    Fields the user set are kept, and later choices follow them (an explicit device "cpu" on
    a GPU machine gets the CPU policy throughout). `world_size`: the processes of the run; under
    FSDP each device is sized for its shard of the base. Without `model_info` the model's shapes are
    read from a config.json already on disk (`model_info_for`); when none is at hand the
    choices that depend on model size fall back to safe ones and say so.
    """
    cfg = config.copy()
    info = model_info if model_info is not None else model_info_for(cfg)
    out = Defaults(config=cfg, model_info=info)
    t, m, fp = cfg.training, cfg.model, cfg.fast_paths
    seq, is_demo = cfg.data.max_seq_len, m.name_or_path == "demo"

    out.fill("training.device", lambda: device_default(profile))
    budget, budget_reason = memory_budget(t.device, profile)
    # The budget has no config field; it travels as a note so every reason that cites it can be
    # traced to the measurement and the kind's margin.
    out.notes["memory.budget"] = (_gib(budget.memory), budget_reason)
    out.warnings += machine_warnings(t.device, profile, budget)
    out.fill("model.dtype", lambda: dtype_default(profile, budget))
    out.fill("fast_paths.ce_chunk_tokens", lambda: ce_chunk_default(info, budget))
    size = Sizer(info, seq, cfg.lora.r, fp.ce_chunk_tokens)
    if t.distributed == "fsdp":
        out.fill("model.load_in_4bit", load_in_4bit_for_fsdp)
    out.fill("model.load_in_4bit", lambda: load_in_4bit_default(profile, budget, size))
    out.fill("training.distributed", lambda: distributed_default(budget, info, m.load_in_4bit))
    if world_size > 1 and t.distributed == "fsdp" and info is not None:
        size = replace(size, shards=world_size)
        out.notes["memory.sharded"] = (
            f"1/{world_size} of the base",
            f"FSDP over {world_size} processes: each device holds its shard of the base and two gathered layers",
        )
    mode = training_mode(m.load_in_4bit, m.dtype)
    target = micro_batch_target(t.rows_per_micro_batch, seq, budget, info, is_demo)
    probe = target if t.rows_per_micro_batch != AUTO or not budget.on_gpu else min(target, NO_CHECKPOINT_PROBE_TOKENS)
    out.fill("training.gradient_checkpointing", lambda: checkpointing_default(budget, size, mode, probe, is_demo))
    ckpt = t.gradient_checkpointing is True
    sized_with = t.offload if t.offload != AUTO else planned_offload(profile, budget, ckpt, size, mode)
    out.fill("training.rows_per_micro_batch", lambda: rows_default(budget, size, mode, target, ckpt, sized_with))
    tokens = t.rows_per_micro_batch * seq
    out.fill(
        "training.offload",
        lambda: offload_default(profile, budget, size, mode, tokens, ckpt),
    )
    kernels = kernels_default(profile, budget)
    for name in ("kernels", "lora_autograd", "fused_ce"):
        out.fill(f"fast_paths.{name}", lambda: kernels)
    out.fill("fast_paths.packed_attention", lambda: packed_attention_default(kernels[0]))
    out.fill("fast_paths.moe_grouping", moe_grouping_default)
    if info is not None:
        out.estimate, out.verdict, warning = fit_check(size, mode, tokens, ckpt, t.offload, budget)
        out.warnings += [warning] if warning else []
    return out


def apply_defaults(
    config: RunConfig, profile: HardwareProfile, model_info: est.ModelInfo | None = None, world_size: int = 1
) -> RunConfig:
    """A copy of `config` with every hardware "auto" field filled, listed in `auto_fields`, and
    its reason in `auto_reasons` (`explain_defaults` lists them). For the notes, warnings and
    estimate as well, call `resolve_defaults`."""
    return resolve_defaults(config, profile, model_info, world_size).config


def explain_defaults(config: RunConfig) -> list[str]:
    """One line per value the hardware policy chose for `config`, with its reason, read from
    the config itself (`auto_fields`, `auto_reasons`), so a config reloaded from YAML explains
    itself too. `Defaults.explain()` adds the notes and warnings of a fresh resolution."""
    lines = []
    for path in config.auto_fields:
        section, _, name = path.partition(".")
        value = getattr(getattr(config, section, None), name, None)
        lines.append(f"{path} = {_show(value)}: {config.auto_reasons.get(path, 'chosen by the hardware policy')}")
    return lines


def model_info_for(config: RunConfig) -> est.ModelInfo | None:
    """The model's shapes when its config.json is already on disk: the bundled demo, a local
    folder, or a Hub id in the local Hugging Face cache. Never downloads, never runs remote
    code; None when the config is not at hand."""
    name = config.model.name_or_path
    if name == "demo":
        from engine.resources import DEMO_MODEL_DIR

        return est.model_info_from_path(DEMO_MODEL_DIR)
    path = Path(name).expanduser()
    if path.is_dir():
        return est.model_info_from_path(path)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # hub library missing or an odd id: the size is simply not known
            return None
        if isinstance(cached, str):
            return est.model_info_from_path(Path(cached).parent)
    return None


def _demo_config() -> RunConfig:
    """The bundled demo preset when present, else the built-in defaults (also the demo)."""
    from engine.resources import DEMO_PRESET

    try:
        return RunConfig.load(DEMO_PRESET)
    except Exception:  # preset missing or being edited: the dataclass defaults are the demo too
        return RunConfig()


def format_profile(
    profile: HardwareProfile, config: RunConfig | None = None, model_info: est.ModelInfo | None = None
) -> str:
    """The report `tunesmith hw` prints: the machine, then the defaults for `config` (default:
    the demo config) with their reasons."""
    p = profile
    lines = ["Hardware", f"  kind       {p.kind} ({p.kind_reason})"]
    if p.gpu_name:
        count = f" x{p.gpu_count}" if p.gpu_count > 1 else ""
        lines.append(f"  GPU        {p.gpu_name}{count}, compute {_cap(p)}, bf16 {'yes' if p.bf16_supported else 'no'}")
        memory_kind = "unified with the host" if p.integrated_memory else "dedicated"
        lines.append(f"  memory     {_gib(p.total_vram)} total, {_gib(p.free_vram)} free ({memory_kind})")
    lines.append(
        f"  host       {p.os} {p.arch}, {p.cpu_count} CPUs, RAM {_gib(p.ram_total)} total, "
        f"{_gib(p.ram_available)} available"
    )
    software = f"torch {p.torch_version or 'missing'}, CUDA {p.cuda_version or 'none'}"
    if p.driver_version:
        software += f", driver {p.driver_version}"
    software += f", Triton {'yes' if p.triton_available else 'no'}"
    lines.append(f"  software   {software}")
    if p.note:
        lines.append(f"  note       {p.note}")

    config = config or _demo_config()
    defaults = resolve_defaults(config, p, model_info)
    info = defaults.model_info
    model = info.summary() if info else f"{config.model.name_or_path} (size not known yet)"
    lines += ["", f"Defaults for {model}, data.max_seq_len {config.data.max_seq_len}"]
    lines += [f"  {line}" for line in defaults.explain()]
    if defaults.estimate is not None:
        lines.append(f"  estimate   ~{_gib(defaults.estimate)}: {defaults.verdict}")
    return "\n".join(lines)
