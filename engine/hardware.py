"""Hardware detection and the defaults policy that fills a RunConfig's "auto" fields.

`detect()` reads the machine (torch, optional NVML, psutil) into a `HardwareProfile` whose
`kind` is one of "rtx_laptop", "rtx_desktop", "datacenter", "dgx_spark" or "cpu".
`profile_from_properties(...)` and `classify(...)` are pure: they take device properties as
arguments, so every class can be built and tested on any machine.

`resolve_defaults(config, profile, model_info)` chooses a value and a reason for each "auto"
field; `apply_defaults` returns the filled copy (its dotted paths listed in
`config.auto_fields`); `explain_defaults` gives the reasons back as lines; `format_profile`
is the text `tunesmith hw` prints.

torch is imported only inside `detect()`, so the studio window can import this module and
open before torch loads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import AUTO, RunConfig
from engine.models import estimate as est

GiB = 1024**3
MiB = 1024**2

KINDS = ("rtx_laptop", "rtx_desktop", "datacenter", "dgx_spark", "cpu")

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
# Triton kernels are run on Turing (sm_75) and newer; older parts use the torch references.
MIN_FAST_PATH_CAPABILITY = (7, 5)


# -- profile ---------------------------------------------------------------------------------


@dataclass
class GpuProperties:
    """What the classifier needs to know about one device (injectable for tests)."""

    name: str
    total_memory: int  # bytes
    capability: tuple[int, int]
    integrated: bool = False  # shares system memory (DGX Spark, Jetson)
    free_memory: int | None = None  # bytes; None: assume all of it is free


@dataclass
class HardwareProfile:
    kind: str  # one of KINDS
    kind_reason: str
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    total_vram: int  # bytes of device memory (0 without a usable GPU)
    free_vram: int
    integrated_memory: bool  # unified memory: the "VRAM" is host RAM
    gpu_count: int
    bf16_supported: bool
    ram_total: int
    ram_available: int
    cpu_count: int
    os: str  # platform.system(): Linux, Windows, Darwin
    arch: str  # platform.machine(): x86_64, AMD64, aarch64, arm64
    torch_version: str | None
    cuda_version: str | None
    backend: str = "cuda"  # "cuda", "rocm", "mps" or "none": what torch found
    driver_version: str | None = None
    triton_available: bool = False
    note: str | None = None  # e.g. why a found accelerator is not used

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d

    @property
    def has_gpu(self) -> bool:
        """A GPU the engine trains on (CUDA)."""
        return self.kind != "cpu"

    @property
    def usable_memory(self) -> int:
        """Bytes a run may plan around on its device.

        Discrete GPU: the card's memory. Unified memory: what the system can actually give
        (the OS and other programs share it). CPU: available host RAM.
        """
        if not self.has_gpu:
            return self.ram_available
        if self.integrated_memory:
            return min(self.total_vram, self.free_vram)
        return self.total_vram


_LAPTOP = re.compile(r"laptop|mobile|max-?q|max-?p|\bmx\s?\d{3}\b", re.I)
_DATACENTER = re.compile(
    r"\b(a100|a800|h100|h800|h200|h20|gh200|b100|b200|b300|gb200|gb300|l40s?|l4|l20|a10g?|a16|a2|"
    r"a30|a40|t4|v100|p100|p40|k80|m60)\b|tesla|server edition|\bhgx\b",
    re.I,
)
_DESKTOP = re.compile(r"geforce|\brtx\b|quadro|titan|ada generation|blackwell", re.I)
_SPARK = re.compile(r"\bgb10\b", re.I)
# Capabilities only datacenter parts have: A100/A30 (8.0), H100/H200/GH200 (9.0), B200/GB200
# (10.0), B300 (10.3). Consumer Ampere is 8.6, Ada 8.9, consumer Blackwell 12.0.
_DATACENTER_CAPS = {(8, 0), (9, 0), (10, 0), (10, 3)}


def classify(gpu: GpuProperties | None, *, backend: str = "cuda", arch: str = "x86_64") -> tuple[str, str]:
    """(kind, reason) for a device, from its properties alone."""
    if backend == "mps":
        return "cpu", ("Apple MPS found, but the engine needs CUDA for 4-bit loading and its Triton "
                       "kernels; training runs on the CPU for now")
    if backend == "rocm":
        return "cpu", (f"{gpu.name} is a ROCm GPU; the engine's kernels and 4-bit path target CUDA "
                       "for now, so training runs on the CPU")
    if gpu is None or backend == "none":
        return "cpu", "no GPU found by torch"
    name = gpu.name
    if _SPARK.search(name):
        return "dgx_spark", f"{name}: DGX Spark (GB10, unified memory, {arch})"
    if gpu.integrated:
        return "dgx_spark", (f"{name} shares system memory ({arch}); treated like DGX Spark "
                             "(unified-memory policy)")
    if _DATACENTER.search(name):
        return "datacenter", f"{name}: datacenter part by name"
    if _LAPTOP.search(name):
        return "rtx_laptop", f"{name}: mobile part by name"
    if _DESKTOP.search(name):
        return "rtx_desktop", f"{name}: desktop / workstation part by name"
    if tuple(gpu.capability) in _DATACENTER_CAPS:
        cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
        return "datacenter", f"{name}: compute capability {cap} is datacenter-only"
    return "rtx_desktop", f"{name}: not recognised; treated as a discrete desktop GPU"


def profile_from_properties(
    gpu: GpuProperties | None = None,
    *,
    gpu_count: int | None = None,
    backend: str = "cuda",
    arch: str = "x86_64",
    os_name: str = "Linux",
    cpu_count: int = 8,
    ram_total: int = 32 * GiB,
    ram_available: int | None = None,
    torch_version: str | None = None,
    cuda_version: str | None = None,
    driver_version: str | None = None,
    triton_available: bool = True,
    bf16_supported: bool | None = None,
    note: str | None = None,
) -> HardwareProfile:
    """A HardwareProfile from given facts; `detect()` feeds it the real ones."""
    if gpu is None:
        backend = "none" if backend == "cuda" else backend
    kind, reason = classify(gpu, backend=backend, arch=arch)
    ram_available = ram_total if ram_available is None else ram_available
    if gpu is None:
        return HardwareProfile(
            kind=kind, kind_reason=reason, gpu_name=None, compute_capability=None, total_vram=0,
            free_vram=0, integrated_memory=False, gpu_count=0, bf16_supported=False,
            ram_total=ram_total, ram_available=ram_available, cpu_count=cpu_count, os=os_name,
            arch=arch, torch_version=torch_version, cuda_version=cuda_version, backend=backend,
            driver_version=driver_version, triton_available=triton_available, note=note,
        )
    free = gpu.total_memory if gpu.free_memory is None else gpu.free_memory
    if gpu.integrated:
        # On unified memory cudaMemGetInfo leaves out reclaimable page cache and under-reports
        # (a known DGX Spark quirk); the OS's "available" is the better figure.
        free = min(gpu.total_memory, max(free, ram_available))
    if bf16_supported is None:
        bf16_supported = backend == "cuda" and tuple(gpu.capability) >= (8, 0)
    return HardwareProfile(
        kind=kind, kind_reason=reason, gpu_name=gpu.name, compute_capability=tuple(gpu.capability),
        total_vram=gpu.total_memory, free_vram=free, integrated_memory=gpu.integrated,
        gpu_count=1 if gpu_count is None else gpu_count, bf16_supported=bool(bf16_supported),
        ram_total=ram_total, ram_available=ram_available, cpu_count=cpu_count, os=os_name, arch=arch,
        torch_version=torch_version, cuda_version=cuda_version, backend=backend,
        driver_version=driver_version, triton_available=triton_available, note=note,
    )


def _nvml_driver_version() -> str | None:
    """NVIDIA driver version via NVML, if pynvml is installed (optional dependency)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing from the driver install, or not an NVIDIA machine
        return None


def detect() -> HardwareProfile:
    """The profile of this machine (GPU 0 is the one the engine trains on)."""
    import psutil

    vm = psutil.virtual_memory()
    host = dict(
        arch=platform.machine() or "unknown", os_name=platform.system() or "unknown",
        cpu_count=os.cpu_count() or 1, ram_total=int(vm.total), ram_available=int(vm.available),
        triton_available=importlib.util.find_spec("triton") is not None,
    )
    try:
        import torch
    except Exception as exc:  # a broken install should still let `tunesmith hw` say so
        return profile_from_properties(None, backend="none", note=f"torch is not importable: {exc}", **host)

    versions = dict(torch_version=torch.__version__, cuda_version=torch.version.cuda)
    hip = getattr(torch.version, "hip", None)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        free = None
        try:
            free, _ = torch.cuda.mem_get_info(0)
        except Exception:  # e.g. device busy in exclusive mode: assume all free
            pass
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # older torch without the keyword
            bf16 = torch.cuda.is_bf16_supported()
        gpu = GpuProperties(
            name=props.name, total_memory=int(props.total_memory), capability=(props.major, props.minor),
            integrated=bool(getattr(props, "is_integrated", False)),
            free_memory=None if free is None else int(free),
        )
        note = None
        count = torch.cuda.device_count()
        if count > 1:
            note = f"{count} GPUs found; the engine trains on one (cuda:0)"
        return profile_from_properties(
            gpu, gpu_count=count, backend="rocm" if hip else "cuda", bf16_supported=bool(bf16) and not hip,
            driver_version=None if hip else _nvml_driver_version(), note=note, **versions, **host,
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return profile_from_properties(None, backend="mps", **versions, **host)
    note = None
    if torch.version.cuda is None and not hip:
        note = "this torch build has no CUDA support (CPU-only wheel)"
    return profile_from_properties(None, note=note, **versions, **host)


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
