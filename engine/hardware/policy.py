"""The defaults policy: fills a RunConfig's "auto" fields from a HardwareProfile.

One function per decision, each returning its value and the reason for it (a `Decision`):
`device_default`, `dtype_default`, `ce_chunk_default`, `load_in_4bit_default`,
`checkpointing_default`, `rows_default`, `offload_default`, `kernels_default` (kernels,
lora_autograd and fused_ce together), `packed_attention_default`, `moe_grouping_default`,
`num_workers_default` (a note: no config field), then `machine_warnings` and `fit_check`.
Later decisions follow earlier ones, so they read the memory `Budget` of the settled device and
estimate with a `Sizer` that carries the settled CE chunk.

`resolve_defaults(config, profile, model_info)` calls them in order and returns `Defaults`: the
filled copy of the config (each choice listed in `auto_fields`, its reason in `auto_reasons`)
with the notes, warnings, estimate and verdict beside it. `apply_defaults` is the filled config
alone; `explain_defaults(config)` lists its automatic values with their reasons, from the config
itself (so also for a run's reloaded config.yaml), and `Defaults.explain()` adds the notes and
warnings. `format_profile` is the text `tunesmith hw` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.config import AUTO, RunConfig
from engine.hardware.profile import MIN_FAST_PATH_CAPABILITY, GiB, HardwareProfile, MiB
from engine.models import estimate as est

# Used to size the cross-entropy chunk when the model is not known yet: a large modern
# vocabulary (Qwen), so the chunk is never too big for the model that does get loaded.
DEFAULT_VOCAB = 151_936
# Fraction of device memory the policy plans to fill; the rest absorbs estimate error,
# other processes and the display (laptops drive a screen from the same GPU).
PLAN_FRACTION = est.FIT_FRACTION
# Below this fraction of usable memory, skipping checkpointing buys speed safely.
NO_CHECKPOINT_FRACTION = 0.5
# Fused cross-entropy chunk: chunk_tokens * vocab * 4 bytes stays under this share of free
# memory, and under an absolute cap (larger chunks stop getting faster).
CE_BUDGET_FRACTION = 0.04
CE_BUDGET_CAP = 1 * GiB
# Double-buffered offload needs one more layer's activations on the device (<= 0.5 GiB in the
# reference workloads); this is what it costs when the model is not known.
DOUBLE_BUFFER_EXTRA_UNKNOWN = 512 * MiB

# A decided value and the reason for it, as shown to the user.
Decision = tuple[Any, str]


# -- what the decisions share ------------------------------------------------------------------


@dataclass
class Defaults:
    """What `resolve_defaults` chose: the filled config and a reason for every choice."""

    config: RunConfig
    # Dotted config path -> (value, reason), for each field that was "auto".
    choices: dict[str, Decision] = field(default_factory=dict)
    # Values without a config field (e.g. data.num_workers) -> (value, reason).
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
    memory: int  # usable bytes of the device the run trains on (VRAM, unified memory or RAM)
    free: int  # bytes free there now
    where: str  # "VRAM", "unified memory" or "RAM", for the reasons

    @property
    def plan(self) -> float:
        """The bytes the policy plans to fill."""
        return PLAN_FRACTION * self.memory


def budget_for(device: str, profile: HardwareProfile) -> Budget:
    on_gpu = device == "cuda" and profile.has_gpu
    where = "VRAM" if on_gpu and not profile.integrated_memory else "unified memory" if on_gpu else "RAM"
    if on_gpu:
        return Budget(True, profile.usable_memory, profile.free_vram, where)
    return Budget(False, profile.ram_available, profile.ram_available, where)


@dataclass(frozen=True)
class Sizer:
    """The run's estimated peak memory for candidate settings (engine.models.estimate); only
    called when the model's shapes are known."""

    info: est.ModelInfo | None
    seq: int
    r: int
    ce_chunk_tokens: int

    def __call__(self, mode: str, tokens: int, ckpt: bool, offload: str) -> int:
        return est.estimate_vram(
            self.info, self.seq, self.r, mode, tokens, ckpt, offload=offload, ce_chunk_tokens=self.ce_chunk_tokens
        )


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
    if profile.gpu_count > 1 and budget.on_gpu:
        return [f"{profile.gpu_count} GPUs found; training uses one (cuda:0)"]
    return []


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
    budget_bytes = min(CE_BUDGET_FRACTION * budget.free, CE_BUDGET_CAP)
    chunk = max(128, min(8192, _pow2_floor(budget_bytes / (vocab * 4))))
    return chunk, (
        f"{chunk} x {vocab} vocab x 4 B = {chunk * vocab * 4 / MiB:.0f} MiB of fp32 logits per chunk, "
        f"within {CE_BUDGET_FRACTION:.0%} of free {budget.where} ({_gib(budget.free)}), "
        f"capped at {_gib(CE_BUDGET_CAP)}"
    )


def load_in_4bit_default(profile: HardwareProfile, budget: Budget, size: Sizer) -> Decision:
    if not budget.on_gpu:
        return False, "bitsandbytes 4-bit needs a CUDA GPU"
    if size.info is None:
        return False, "model size not known yet; 16-bit (set load_in_4bit: true for a model near the VRAM size)"
    seq = size.seq
    lean = size("lora16", seq, True, "off" if profile.integrated_memory else "single")
    if lean > budget.plan:
        return True, (
            f"16-bit LoRA needs ~{_gib(lean)} even at one {seq}-token row, over "
            f"{PLAN_FRACTION:.0%} of {_gib(budget.memory)} {budget.where}"
        )
    return False, (
        f"16-bit LoRA at one {seq}-token row needs ~{_gib(lean)}, within "
        f"{PLAN_FRACTION:.0%} of {_gib(budget.memory)} {budget.where}"
    )


def _token_target(memory: int) -> int:
    """Tokens per micro-batch that keep a GPU of this size busy without crowding it."""
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
    """Tokens per micro-batch before fitting them to memory: the user's rows when set."""
    if rows != AUTO:
        return rows * seq
    if budget.on_gpu:
        return _token_target(budget.memory)
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
            f"{NO_CHECKPOINT_FRACTION:.0%} of {_gib(budget.memory)} {budget.where}: skip the recompute"
        )
    return True, (
        f"without it a {target}-token micro-batch needs ~{_gib(full)}, over "
        f"{NO_CHECKPOINT_FRACTION:.0%} of {_gib(budget.memory)} {budget.where}"
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


def planned_offload(profile: HardwareProfile, budget: Budget, ckpt: bool) -> str:
    """The offload the micro-batch is sized with, before `offload_default` settles it beside
    that micro-batch (the double buffer needs headroom next to it)."""
    return "off" if offload_off_reason(profile, budget, ckpt) else "double"


def rows_default(budget: Budget, size: Sizer, mode: str, target: int, ckpt: bool, offload: str) -> Decision:
    """Rows per micro-batch: the target, halved until the estimate fits."""
    seq = size.seq
    rows = max(1, target // seq)
    fits_note = ""
    if size.info is not None:
        while rows > 1 and size(mode, rows * seq, ckpt, offload) > budget.plan:
            rows //= 2
        fits_note = f", ~{_gib(size(mode, rows * seq, ckpt, offload))} estimated"
    if budget.on_gpu:
        why = f"~{target} tokens suit {_gib(budget.memory)} {budget.where}"
    else:
        why = "CPU: small micro-batches keep steps short"
    return rows, f"{rows} x {seq} = {rows * seq} tokens per micro-batch; {why}{fits_note}"


def offload_default(
    profile: HardwareProfile, budget: Budget, size: Sizer, mode: str, tokens: int, ckpt: bool, wide: bool
) -> Decision:
    """Activation offload: off where it cannot help, else double-buffered when free memory
    leaves room for the second buffer beside the run, else single."""
    off = offload_off_reason(profile, budget, ckpt)
    if off:
        return "off", off
    if size.info:
        need = size(mode, tokens, ckpt, "single")
        extra = tokens * size.info.hidden_size * (4 if wide else 2)
    else:
        # The run's own size is unknown: ask that the card be as free as the plan
        # assumes (others' use of it is all that can be seen).
        need = int((1 - PLAN_FRACTION) * profile.total_vram)
        extra = DOUBLE_BUFFER_EXTRA_UNKNOWN
    margin = int(0.05 * profile.total_vram)
    headroom = budget.free - need
    if headroom >= extra + margin:
        return "double", (
            f"free VRAM leaves {_gib(headroom)} beside the run; the second buffer needs "
            f"~{extra / MiB:.0f} MiB and hides the copies behind compute"
        )
    return "single", (
        f"free VRAM leaves only {_gib(max(headroom, 0))} beside the run: one buffer, no room for the second"
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


def num_workers_default(profile: HardwareProfile, budget: Budget) -> Decision:
    """Data loader workers: there is no config field, so the value travels as a note."""
    if not budget.on_gpu:
        return 0, "CPU training uses every core; packing stays on the main thread"
    if profile.os == "Windows":
        return 0, "Windows spawns workers by re-importing torch, which costs more than packing"
    return (
        min(4, max(0, profile.cpu_count // 2 - 1)),
        f"{profile.cpu_count} CPUs: tokenize and pack ahead of the GPU, leaving cores for the main loop",
    )


def fit_check(
    size: Sizer, mode: str, tokens: int, ckpt: bool, offload: str, budget: Budget
) -> tuple[int, str, str | None]:
    """The estimate for the settled config, its verdict, and a warning unless it fits."""
    estimate = size(mode, tokens, ckpt, offload)
    verdict = est.fit_verdict(estimate, budget.memory)
    if verdict == "fits":
        return estimate, verdict, None
    return (
        estimate,
        verdict,
        (
            f"{size.info.summary()}: ~{_gib(estimate)} estimated in {_gib(budget.memory)} {budget.where}: {verdict}"
            + ("; try a shorter data.max_seq_len or a smaller model" if verdict == "will not fit" else "")
        ),
    )


# -- the policy --------------------------------------------------------------------------------


def resolve_defaults(config: RunConfig, profile: HardwareProfile, model_info: est.ModelInfo | None = None) -> Defaults:
    """Fill every hardware-dependent "auto" field of a copy of `config`, with reasons.

    Fields the user set are kept, and later choices follow them (an explicit device "cpu" on
    a GPU machine gets the CPU policy throughout). Without `model_info` the model's shapes are
    read from a config.json already on disk (`model_info_for`); when none is at hand the
    choices that depend on model size fall back to safe ones and say so.
    """
    cfg = config.copy()
    info = model_info if model_info is not None else model_info_for(cfg)
    out = Defaults(config=cfg, model_info=info)
    t, m, fp = cfg.training, cfg.model, cfg.fast_paths
    seq, is_demo = cfg.data.max_seq_len, m.name_or_path == "demo"

    out.fill("training.device", lambda: device_default(profile))
    budget = budget_for(t.device, profile)
    out.warnings += machine_warnings(t.device, profile, budget)
    out.fill("model.dtype", lambda: dtype_default(profile, budget))
    out.fill("fast_paths.ce_chunk_tokens", lambda: ce_chunk_default(info, budget))
    size = Sizer(info, seq, cfg.lora.r, fp.ce_chunk_tokens)
    out.fill("model.load_in_4bit", lambda: load_in_4bit_default(profile, budget, size))
    mode = training_mode(m.load_in_4bit, m.dtype)
    target = micro_batch_target(t.rows_per_micro_batch, seq, budget, info, is_demo)
    out.fill("training.gradient_checkpointing", lambda: checkpointing_default(budget, size, mode, target, is_demo))
    ckpt = t.gradient_checkpointing is True
    sized_with = t.offload if t.offload != AUTO else planned_offload(profile, budget, ckpt)
    out.fill("training.rows_per_micro_batch", lambda: rows_default(budget, size, mode, target, ckpt, sized_with))
    tokens = t.rows_per_micro_batch * seq
    out.fill(
        "training.offload",
        lambda: offload_default(profile, budget, size, mode, tokens, ckpt, wide=m.dtype == "float32"),
    )
    kernels = kernels_default(profile, budget)
    for name in ("kernels", "lora_autograd", "fused_ce"):
        out.fill(f"fast_paths.{name}", lambda: kernels)
    out.fill("fast_paths.packed_attention", lambda: packed_attention_default(kernels[0]))
    out.fill("fast_paths.moe_grouping", moe_grouping_default)
    out.notes["data.num_workers"] = num_workers_default(profile, budget)
    if info is not None:
        out.estimate, out.verdict, warning = fit_check(size, mode, tokens, ckpt, t.offload, budget)
        out.warnings += [warning] if warning else []
    return out


def apply_defaults(config: RunConfig, profile: HardwareProfile, model_info: est.ModelInfo | None = None) -> RunConfig:
    """A copy of `config` with every hardware "auto" field filled, listed in `auto_fields`, and
    its reason in `auto_reasons` (`explain_defaults` lists them). For the notes, warnings and
    estimate as well, call `resolve_defaults`."""
    return resolve_defaults(config, profile, model_info).config


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
