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

The decisions live in one module per group, and this module is the policy that takes them in
order: engine.hardware.kinds (KIND_RULES), budget (Budget, memory_budget, Sizer, Decision),
model_choices (device, dtype, 4 bits, DDP/FSDP, machine warnings), memory_plan (micro-batch,
checkpointing, rows, offload, fit check), fast_path_choices (CE chunk, kernels, packed
attention, MoE grouping). Callers know every name as policy.<name>.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from engine.config import AUTO, RunConfig
from engine.hardware.budget import (
    BUSY_CARD_FRACTION,
    BUSY_TOKENS,
    CE_BUDGET_CAP,
    CE_BUDGET_FRACTION,
    DEFAULT_VOCAB,
    DOUBLE_BUFFER_EXTRA_UNKNOWN,
    NO_CHECKPOINT_FRACTION,
    NO_CHECKPOINT_PROBE_TOKENS,
    Budget,
    Decision,
    Sizer,
    _cap,
    _gib,
    _show,
    budget_for,
    memory_budget,
    training_mode,
)
from engine.hardware.fast_path_choices import (
    ce_chunk_default,
    kernels_default,
    lean_recompute_planned,
    moe_grouping_default,
    packed_attention_default,
)
from engine.hardware.kinds import CPU_PLAN_FRACTION, KIND_RULES, KindRules
from engine.hardware.memory_plan import (
    checkpointing_default,
    fit_check,
    micro_batch_target,
    offload_default,
    offload_off_reason,
    planned_offload,
    rows_default,
)
from engine.hardware.model_choices import (
    FSDP_WEIGHTS_SHARE,
    device_default,
    distributed_default,
    dtype_default,
    load_in_4bit_default,
    load_in_4bit_for_fsdp,
    machine_warnings,
)
from engine.hardware.profile import HardwareProfile
from engine.models import estimate as est

# The decisions live in one module per group (kinds, budget, model_choices, memory_plan,
# fast_path_choices); callers know them as policy.<name>.
__all__ = [
    "KindRules",
    "KIND_RULES",
    "DEFAULT_VOCAB",
    "CPU_PLAN_FRACTION",
    "NO_CHECKPOINT_FRACTION",
    "CE_BUDGET_FRACTION",
    "CE_BUDGET_CAP",
    "DOUBLE_BUFFER_EXTRA_UNKNOWN",
    "BUSY_TOKENS",
    "NO_CHECKPOINT_PROBE_TOKENS",
    "BUSY_CARD_FRACTION",
    "Decision",
    "Budget",
    "memory_budget",
    "budget_for",
    "Sizer",
    "training_mode",
    "device_default",
    "machine_warnings",
    "dtype_default",
    "load_in_4bit_default",
    "load_in_4bit_for_fsdp",
    "FSDP_WEIGHTS_SHARE",
    "distributed_default",
    "micro_batch_target",
    "checkpointing_default",
    "offload_off_reason",
    "planned_offload",
    "rows_default",
    "offload_default",
    "fit_check",
    "ce_chunk_default",
    "kernels_default",
    "packed_attention_default",
    "moe_grouping_default",
    "lean_recompute_planned",
    "Defaults",
    "resolve_defaults",
    "apply_defaults",
    "explain_defaults",
    "model_info_for",
    "format_profile",
]


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
    kernels = kernels_default(profile, budget)  # filled below; the estimate asks what it will be
    lean = lean_recompute_planned(fp, cfg.lora.dropout, info, kernels[0])
    size = Sizer(info, seq, cfg.lora.r, fp.ce_chunk_tokens, lean_recompute=lean)
    if t.distributed == "fsdp":
        out.fill("model.load_in_4bit", load_in_4bit_for_fsdp)
    out.fill("model.load_in_4bit", lambda: load_in_4bit_default(profile, budget, size))
    out.fill("training.distributed", lambda: distributed_default(budget, info, m.load_in_4bit, size))
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
