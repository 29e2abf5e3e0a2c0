"""The defaults policy: fills a RunConfig's "auto" fields from a HardwareProfile.

`resolve_defaults(config, profile, model_info)` chooses a value and a reason for each "auto"
field; `apply_defaults` returns the filled copy (its dotted paths listed in
`config.auto_fields`); `explain_defaults` gives the reasons back as lines; `format_profile`
is the text `tunesmith hw` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import AUTO, RunConfig
from engine.models import estimate as est

from engine.hardware.profile import GiB, MiB, MIN_FAST_PATH_CAPABILITY, HardwareProfile

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



# -- defaults policy ---------------------------------------------------------------------------


@dataclass
class Defaults:
    """What `resolve_defaults` chose: the filled config and a reason for every choice."""

    config: RunConfig
    # Dotted config path -> (value, reason), for each field that was "auto".
    choices: dict[str, tuple[Any, str]] = field(default_factory=dict)
    # Values without a config field (e.g. data.num_workers) -> (value, reason).
    notes: dict[str, tuple[Any, str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    model_info: est.ModelInfo | None = None
    estimate: int | None = None  # bytes for the chosen settings, when the model is known
    verdict: str | None = None

    def explain(self) -> list[str]:
        lines = [f"{path} = {_show(value)}: {reason}" for path, (value, reason) in self.choices.items()]
        lines += [f"{path} = {_show(value)} (no config field): {reason}" for path, (value, reason) in self.notes.items()]
        lines += [f"warning: {w}" for w in self.warnings]
        return lines


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


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
    seq = cfg.data.max_seq_len
    r = cfg.lora.r
    is_demo = m.name_or_path == "demo"

    def choose(path: str, value: Any, reason: str) -> None:
        section, name = path.split(".")
        setattr(getattr(cfg, section), name, value)
        out.choices[path] = (value, reason)
        if path not in cfg.auto_fields:
            cfg.auto_fields.append(path)

    # Device.
    if t.device == AUTO:
        if profile.has_gpu:
            choose("training.device", "cuda", f"{profile.gpu_name} ({profile.kind})")
        else:
            choose("training.device", "cpu", profile.kind_reason)
    on_gpu = t.device == "cuda" and profile.has_gpu
    if t.device == "cuda" and not profile.has_gpu:
        out.warnings.append(f"training.device is cuda but {profile.kind_reason}")
    memory = profile.usable_memory if on_gpu else profile.ram_available
    free = profile.free_vram if on_gpu else profile.ram_available
    where = "VRAM" if on_gpu and not profile.integrated_memory else "unified memory" if on_gpu else "RAM"
    plan = PLAN_FRACTION * memory

    # Precision.
    if m.dtype == AUTO:
        if not on_gpu:
            choose("model.dtype", "float32", "CPU: 16-bit matmuls are slow or missing on CPUs")
        elif profile.bf16_supported:
            choose("model.dtype", "bfloat16", f"compute capability {_cap(profile)} supports bf16")
        else:
            choose("model.dtype", "float16", f"compute capability {_cap(profile)} has no bf16")
    wide = m.dtype == "float32"

    # Cross-entropy chunk: it is sized first because every estimate below includes it.
    if fp.ce_chunk_tokens == AUTO:
        vocab = info.vocab_size if info else DEFAULT_VOCAB
        budget = min(CE_BUDGET_FRACTION * free, CE_BUDGET_CAP)
        chunk = max(128, min(8192, _pow2_floor(budget / (vocab * 4))))
        choose("fast_paths.ce_chunk_tokens", chunk,
               f"{chunk} x {vocab} vocab x 4 B = {chunk * vocab * 4 / MiB:.0f} MiB of fp32 logits per chunk, "
               f"within {CE_BUDGET_FRACTION:.0%} of free {where} ({_gib(free)}), capped at {_gib(CE_BUDGET_CAP)}")
    chunk = fp.ce_chunk_tokens

    def estimate(mode: str, tokens: int, ckpt: bool, offload: str) -> int:
        return est.estimate_vram(info, seq, r, mode, tokens, ckpt, offload=offload, ce_chunk_tokens=chunk)

    # 4-bit base weights.
    if m.load_in_4bit == AUTO:
        if not on_gpu:
            choose("model.load_in_4bit", False, "bitsandbytes 4-bit needs a CUDA GPU")
        elif info is None:
            choose("model.load_in_4bit", False,
                   "model size not known yet; 16-bit (set load_in_4bit: true for a model near the VRAM size)")
        else:
            lean_offload = "off" if profile.integrated_memory else "single"
            lean = estimate("lora16", seq, True, lean_offload)
            if lean > plan:
                choose("model.load_in_4bit", True,
                       f"16-bit LoRA needs ~{_gib(lean)} even at one {seq}-token row, over "
                       f"{PLAN_FRACTION:.0%} of {_gib(memory)} {where}")
            else:
                choose("model.load_in_4bit", False,
                       f"16-bit LoRA at one {seq}-token row needs ~{_gib(lean)}, within "
                       f"{PLAN_FRACTION:.0%} of {_gib(memory)} {where}")
    mode = "qlora4" if m.load_in_4bit is True else "lora32" if wide else "lora16"

    # Target size of a micro-batch, in tokens, before fitting it to memory.
    if t.rows_per_micro_batch != AUTO:
        target = t.rows_per_micro_batch * seq
    elif on_gpu:
        target = _token_target(memory)
    else:
        small = (info is None and is_demo) or (info is not None and info.num_params < 1e9)
        target = 2 * seq if small and seq <= 512 else seq

    # Gradient checkpointing.
    if t.gradient_checkpointing == AUTO:
        if info is None:
            if on_gpu or not is_demo:
                choose("training.gradient_checkpointing", True,
                       "model size not known yet; checkpointing keeps activation memory small")
            else:
                choose("training.gradient_checkpointing", False,
                       "CPU with the small bundled demo model: recomputing would only cost time")
        else:
            full = estimate(mode, target, False, "off")
            if full <= NO_CHECKPOINT_FRACTION * memory:
                choose("training.gradient_checkpointing", False,
                       f"without it a {target}-token micro-batch needs ~{_gib(full)}, under "
                       f"{NO_CHECKPOINT_FRACTION:.0%} of {_gib(memory)} {where}: skip the recompute")
            else:
                choose("training.gradient_checkpointing", True,
                       f"without it a {target}-token micro-batch needs ~{_gib(full)}, over "
                       f"{NO_CHECKPOINT_FRACTION:.0%} of {_gib(memory)} {where}")
    ckpt = t.gradient_checkpointing is True

    # Offload: decided in two steps, because the micro-batch is sized with the offload on
    # and the double buffer then needs headroom next to that micro-batch.
    offload_reason = None
    if t.offload == AUTO:
        if not on_gpu:
            offload_reason = ("off", "CPU: activations already live in host memory")
        elif profile.integrated_memory:
            offload_reason = ("off", "unified memory: the host and the GPU share it, so moving "
                                     "activations saves nothing (and no double buffering)")
        elif not ckpt:
            offload_reason = ("off", "offload moves checkpointed activations; checkpointing is off")
    planned_offload = t.offload if t.offload != AUTO else (offload_reason[0] if offload_reason else "double")

    # Rows per micro-batch: the target, halved until the estimate fits.
    if t.rows_per_micro_batch == AUTO:
        rows = max(1, target // seq)
        fits_note = ""
        if info is not None:
            while rows > 1 and estimate(mode, rows * seq, ckpt, planned_offload) > plan:
                rows //= 2
            fits_note = f", ~{_gib(estimate(mode, rows * seq, ckpt, planned_offload))} estimated"
        if on_gpu:
            why = f"~{target} tokens suit {_gib(memory)} {where}"
        else:
            why = "CPU: small micro-batches keep steps short"
        choose("training.rows_per_micro_batch", rows,
               f"{rows} x {seq} = {rows * seq} tokens per micro-batch; {why}{fits_note}")
    tokens = t.rows_per_micro_batch * seq

    if t.offload == AUTO:
        if offload_reason:
            choose("training.offload", *offload_reason)
        else:
            if info:
                need = estimate(mode, tokens, ckpt, "single")
                extra = tokens * info.hidden_size * (4 if wide else 2)
            else:
                # The run's own size is unknown: ask that the card be as free as the plan
                # assumes (others' use of it is all that can be seen).
                need = int((1 - PLAN_FRACTION) * profile.total_vram)
                extra = DOUBLE_BUFFER_EXTRA_UNKNOWN
            margin = int(0.05 * profile.total_vram)
            headroom = free - need
            if headroom >= extra + margin:
                choose("training.offload", "double",
                       f"free VRAM leaves {_gib(headroom)} beside the run; the second buffer needs "
                       f"~{extra / MiB:.0f} MiB and hides the copies behind compute")
            else:
                choose("training.offload", "single",
                       f"free VRAM leaves only {_gib(max(headroom, 0))} beside the run: one buffer, "
                       "no room for the second")

    # Fast paths.
    fast_ok, fast_reason = _fast_paths_usable(profile, on_gpu)
    for name in ("kernels", "lora_autograd", "fused_ce"):
        if getattr(fp, name) == AUTO:
            choose(f"fast_paths.{name}", fast_ok, fast_reason)
    if fp.packed_attention == AUTO:
        # It is also what keeps packed documents apart, so it is on everywhere: the Triton
        # varlen kernel where the fast paths run, per-document SDPA (the reference) elsewhere.
        choose("fast_paths.packed_attention", True,
               "Triton varlen kernel" if fast_ok else "per-document SDPA reference; documents never attend to each other")
    if fp.moe_grouping == AUTO:
        choose("fast_paths.moe_grouping", True, "plain torch (argsort + bincount): helps on any device")

    # Data loader workers: there is no config field, so the value travels as a note.
    if not on_gpu:
        workers, why = 0, "CPU training uses every core; packing stays on the main thread"
    elif profile.os == "Windows":
        workers, why = 0, "Windows spawns workers by re-importing torch, which costs more than packing"
    else:
        workers = min(4, max(0, profile.cpu_count // 2 - 1))
        why = f"{profile.cpu_count} CPUs: tokenize and pack ahead of the GPU, leaving cores for the main loop"
    out.notes["data.num_workers"] = (workers, why)

    if profile.gpu_count > 1 and on_gpu:
        out.warnings.append(f"{profile.gpu_count} GPUs found; training uses one (cuda:0)")
    if info is not None:
        out.estimate = estimate(mode, tokens, ckpt, t.offload)
        out.verdict = est.fit_verdict(out.estimate, memory)
        if out.verdict != "fits":
            out.warnings.append(
                f"{info.summary()}: ~{_gib(out.estimate)} estimated in {_gib(memory)} {where}: {out.verdict}"
                + ("; try a shorter data.max_seq_len or a smaller model" if out.verdict == "will not fit" else ""))
    return out


def _cap(profile: HardwareProfile) -> str:
    c = profile.compute_capability
    return f"{c[0]}.{c[1]}" if c else "n/a"


def _fast_paths_usable(profile: HardwareProfile, on_gpu: bool) -> tuple[bool, str]:
    if not on_gpu:
        return False, "CPU: the plain-torch reference paths run (the Triton kernels need CUDA)"
    if not profile.triton_available:
        return False, "Triton is not installed: the plain-torch reference paths run"
    if profile.compute_capability and tuple(profile.compute_capability) < MIN_FAST_PATH_CAPABILITY:
        return False, (f"compute capability {_cap(profile)} is older than the Triton kernels support: "
                       "the plain-torch reference paths run")
    return True, "CUDA with Triton: the fused kernels apply"


# Where apply_defaults leaves the whole Defaults (notes and warnings too) on the returned
# config; the per-field reasons also go to RunConfig.auto_reasons, which survives YAML.
_DEFAULTS_ATTR = "_tunesmith_defaults"


def apply_defaults(config: RunConfig, profile: HardwareProfile, model_info: est.ModelInfo | None = None) -> RunConfig:
    """A copy of `config` with every hardware "auto" field filled and listed in `auto_fields`.

    The reasons are available from `explain_defaults(returned_config)`.
    """
    defaults = resolve_defaults(config, profile, model_info)
    # The reasons travel with the config (and into the run's config.yaml).
    defaults.config.auto_reasons.update({path: reason for path, (_, reason) in defaults.choices.items()})
    setattr(defaults.config, _DEFAULTS_ATTR, defaults)
    return defaults.config


def explain_defaults(config: RunConfig) -> list[str]:
    """One line per value the policy chose, with its reason (from `apply_defaults`).

    A config that lost the reasons (reloaded from YAML) still lists its auto fields' values.
    """
    defaults = getattr(config, _DEFAULTS_ATTR, None)
    if defaults is not None:
        return defaults.explain()
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


def format_profile(profile: HardwareProfile, config: RunConfig | None = None,
                   model_info: est.ModelInfo | None = None) -> str:
    """The report `tunesmith hw` prints: the machine, then the defaults for `config` (default:
    the demo config) with their reasons."""
    p = profile
    lines = ["Hardware", f"  kind       {p.kind} ({p.kind_reason})"]
    if p.gpu_name:
        count = f" x{p.gpu_count}" if p.gpu_count > 1 else ""
        lines.append(f"  GPU        {p.gpu_name}{count}, compute {_cap(p)}, bf16 {'yes' if p.bf16_supported else 'no'}")
        memory_kind = "unified with the host" if p.integrated_memory else "dedicated"
        lines.append(f"  memory     {_gib(p.total_vram)} total, {_gib(p.free_vram)} free ({memory_kind})")
    lines.append(f"  host       {p.os} {p.arch}, {p.cpu_count} CPUs, RAM {_gib(p.ram_total)} total, "
                 f"{_gib(p.ram_available)} available")
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
