"""Hardware detection: the machine read into a `HardwareProfile`.

`detect()` reads the machine (torch, optional NVML, psutil) into a `HardwareProfile` whose
`kind` is one of "rtx_laptop", "rtx_desktop", "datacenter", "dgx_spark" or "cpu".
`profile_from_properties(...)` and `classify(...)` are pure: they take device properties as
arguments, so every class can be built and tested on any machine. A GB10 is unified memory by
name even when the driver leaves the integrated flag unset. `TUNESMITH_EMULATE_GPU="<card>:<GiB>"`
makes `detect()` report that card (emulating a laptop on a big GPU, W8); the entry point that
trains caps its own allocator with `cap_to_emulated_card()` (detect() changes nothing).

torch is imported only inside `detect()`, so the studio window can import this module and
open before torch loads. What the profile means for a run is engine.hardware.policy's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import re
from dataclasses import dataclass
from typing import Any

GiB = 1024**3
MiB = 1024**2

KINDS = ("rtx_laptop", "rtx_desktop", "datacenter", "dgx_spark", "cpu")

# "<card name>:<GiB>": detect() emulates that card on this GPU (see emulated_card).
EMULATE_ENV = "TUNESMITH_EMULATE_GPU"

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


def unified_by_name(name: str) -> bool:
    """True for parts known to share memory with the host, whatever the driver reports."""
    return bool(_SPARK.search(name))


def classify(gpu: GpuProperties | None, *, backend: str = "cuda", arch: str = "x86_64") -> tuple[str, str]:
    """(kind, reason) for a device, from its properties alone."""
    if backend == "mps":
        return "cpu", (
            "Apple MPS found, but the engine needs CUDA for 4-bit loading and its Triton "
            "kernels; training runs on the CPU for now"
        )
    if backend == "rocm":
        return "cpu", (
            f"{gpu.name} is a ROCm GPU; the engine's kernels and 4-bit path target CUDA "
            "for now, so training runs on the CPU"
        )
    if gpu is None or backend == "none":
        return "cpu", "no GPU found by torch"
    name = gpu.name
    if _SPARK.search(name):
        return "dgx_spark", f"{name}: DGX Spark (GB10, unified memory, {arch})"
    if gpu.integrated:
        return "dgx_spark", (f"{name} shares system memory ({arch}); treated like DGX Spark (unified-memory policy)")
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
            kind=kind,
            kind_reason=reason,
            gpu_name=None,
            compute_capability=None,
            total_vram=0,
            free_vram=0,
            integrated_memory=False,
            gpu_count=0,
            bf16_supported=False,
            ram_total=ram_total,
            ram_available=ram_available,
            cpu_count=cpu_count,
            os=os_name,
            arch=arch,
            torch_version=torch_version,
            cuda_version=cuda_version,
            backend=backend,
            driver_version=driver_version,
            triton_available=triton_available,
            note=note,
        )
    free = gpu.total_memory if gpu.free_memory is None else gpu.free_memory
    # A GB10 shares LPDDR5x with the Grace CPU whatever the driver reports: some driver / torch
    # combinations leave `is_integrated` False, and the discrete-GPU policy would then offload
    # activations "to host", i.e. to the same memory, paying copies for nothing.
    unified = gpu.integrated or unified_by_name(gpu.name)
    if unified and not gpu.integrated:
        reason += "; the driver did not report integrated memory, but a GB10 always shares it with the host"
    if unified:
        # On unified memory cudaMemGetInfo leaves out reclaimable page cache and under-reports
        # (a known DGX Spark quirk); the OS's "available" is the better figure.
        free = min(gpu.total_memory, max(free, ram_available))
    if bf16_supported is None:
        bf16_supported = backend == "cuda" and tuple(gpu.capability) >= (8, 0)
    return HardwareProfile(
        kind=kind,
        kind_reason=reason,
        gpu_name=gpu.name,
        compute_capability=tuple(gpu.capability),
        total_vram=gpu.total_memory,
        free_vram=free,
        integrated_memory=unified,
        gpu_count=1 if gpu_count is None else gpu_count,
        bf16_supported=bool(bf16_supported),
        ram_total=ram_total,
        ram_available=ram_available,
        cpu_count=cpu_count,
        os=os_name,
        arch=arch,
        torch_version=torch_version,
        cuda_version=cuda_version,
        backend=backend,
        driver_version=driver_version,
        triton_available=triton_available,
        note=note,
    )


def emulated_card(value: str | None) -> tuple[str, int] | None:
    """(card name, bytes) from a `TUNESMITH_EMULATE_GPU` value "<card name>:<GiB>", else None.

    For measuring the defaults of a smaller card on a big one (WORKLOADS.md W8): `detect()` then
    caps this process's allocator at that size and reports the card's name, so the policy sees a
    laptop. A malformed value is ignored rather than failing a run.
    """
    if not value:
        return None
    name, _, size = value.rpartition(":")
    try:
        gib = float(size)
    except ValueError:
        return None
    if not name.strip() or gib <= 0:
        return None
    return name.strip(), int(gib * GiB)


def cap_to_emulated_card(device_index: int = 0) -> int | None:
    """Cap this process's CUDA allocator at the emulated card's size (`TUNESMITH_EMULATE_GPU`),
    so an out-of-memory error comes where the smaller card would give it (the CUDA context
    stays outside, as on the real card); the cap in bytes, or None when nothing is emulated.
    The caller that trains decides this (the TrainingSession at its start), not `detect()`:
    reading the machine must not change it."""
    emulated = emulated_card(os.environ.get(EMULATE_ENV))
    if emulated is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    total = int(torch.cuda.get_device_properties(device_index).total_memory)
    cap = min(emulated[1], total)
    torch.cuda.set_per_process_memory_fraction(cap / total, device_index)
    return cap


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
        arch=platform.machine() or "unknown",
        os_name=platform.system() or "unknown",
        cpu_count=os.cpu_count() or 1,
        ram_total=int(vm.total),
        ram_available=int(vm.available),
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
            name=props.name,
            total_memory=int(props.total_memory),
            capability=(props.major, props.minor),
            integrated=bool(getattr(props, "is_integrated", False)),
            free_memory=None if free is None else int(free),
        )
        note = None
        count = torch.cuda.device_count()
        if count > 1:
            note = f"{count} GPUs found; the engine trains on one (cuda:0)"
        emulated = emulated_card(os.environ.get(EMULATE_ENV))
        if emulated:
            name, cap = emulated
            cap = min(cap, gpu.total_memory)
            free = max(0, cap - int(torch.cuda.memory_reserved(0)))
            note = f"{props.name} emulating {name} with {cap / GiB:.1f} GiB ({EMULATE_ENV})"
            gpu = GpuProperties(name, cap, gpu.capability, integrated=gpu.integrated, free_memory=free)
        return profile_from_properties(
            gpu,
            gpu_count=count,
            backend="rocm" if hip else "cuda",
            bf16_supported=bool(bf16) and not hip,
            driver_version=None if hip else _nvml_driver_version(),
            note=note,
            **versions,
            **host,
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return profile_from_properties(None, backend="mps", **versions, **host)
    note = None
    if torch.version.cuda is None and not hip:
        note = "this torch build has no CUDA support (CPU-only wheel)"
    return profile_from_properties(None, note=note, **versions, **host)
