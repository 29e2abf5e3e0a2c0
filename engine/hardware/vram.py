"""Device-wide memory as the card sees it (issue 14 item 10): used and total across every process,
not only this one's torch allocator. On a laptop the desktop and the browser draw from the same
card, so the headroom really left is total - used.

`device_memory(index, unified=...)` asks, in order:
- unified memory (DGX Spark; pass the profile's `integrated_memory`): the OS, /proc/meminfo's
  MemTotal - MemAvailable. NVML reports no framebuffer there, and cudaMemGetInfo leaves out the
  page cache the OS can reclaim;
- NVML (`pynvml`, optional), whose figure counts every process on the card;
- `torch.cuda.mem_get_info`, only when torch is already imported (this module never imports torch,
  so the window can poll it before a run loads torch).

None when none of them can answer (no GPU). Each call is cheap enough to poll once a second.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class DeviceMemory:
    used: int  # bytes in use on the device by every process (unified: by the whole system)
    total: int  # bytes of the device
    source: str  # "nvml", "cuda" or "os"

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


def os_memory(meminfo: Path | str = MEMINFO) -> DeviceMemory | None:
    """System memory from a /proc/meminfo file: used = MemTotal - MemAvailable (what programs hold
    and the OS cannot reclaim). psutil answers where there is no such file."""
    fields: dict[str, int] = {}
    try:
        for line in Path(meminfo).read_text(encoding="ascii", errors="replace").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                # The kernel writes "kB" and means KiB.
                fields[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        fields = {}
    if "MemTotal" in fields and "MemAvailable" in fields:
        return DeviceMemory(fields["MemTotal"] - fields["MemAvailable"], fields["MemTotal"], "os")
    try:
        import psutil

        vm = psutil.virtual_memory()
        return DeviceMemory(int(vm.total - vm.available), int(vm.total), "os")
    except Exception:  # no psutil: nothing to say
        return None


_nvml_lock = threading.Lock()
_nvml_state: dict[str, object] = {}  # "ok": bool once tried; NVML stays initialised for polling


def _nvml_memory(index: int) -> DeviceMemory | None:
    with _nvml_lock:
        if _nvml_state.get("ok") is False:
            return None
        try:
            import pynvml

            if "ok" not in _nvml_state:
                pynvml.nvmlInit()
                _nvml_state["ok"] = True
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return DeviceMemory(int(info.used), int(info.total), "nvml")
        except ImportError:
            _nvml_state["ok"] = False
            return None
        except Exception:  # NVML without this device or without memory info (GB10): not fatal
            return None


@dataclass(frozen=True)
class GpuHealth:
    """What the card is doing besides holding memory (NVML): each None where the card or the
    driver does not say (a laptop GPU often reports no power limit)."""

    utilization: int | None  # percent of the last sample period the GPU was busy
    temperature: int | None  # degrees Celsius, the GPU core
    power_watts: float | None  # the board's draw now
    power_limit_watts: float | None  # the limit the driver enforces

    def fields(self) -> dict:
        """The optional StepMetrics fields (engine.events) this reading fills."""
        return {"gpu_util": self.utilization, "gpu_temp": self.temperature, "gpu_power": self.power_watts}


def gpu_health(index: int = 0) -> GpuHealth | None:
    """Utilisation, temperature and power of GPU `index` through NVML; None without NVML or a GPU
    (nothing is shown then, and nothing is said: a CPU machine has no card to watch)."""
    with _nvml_lock:
        if _nvml_state.get("ok") is False:
            return None
        try:
            import pynvml

            if "ok" not in _nvml_state:
                pynvml.nvmlInit()
                _nvml_state["ok"] = True
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except ImportError:
            _nvml_state["ok"] = False
            return None
        except Exception:  # no driver, or no such device
            return None

        def ask(fn, *args):
            try:
                return fn(handle, *args)
            except Exception:  # this reading is not supported on this card
                return None

        util = ask(pynvml.nvmlDeviceGetUtilizationRates)
        temp = ask(pynvml.nvmlDeviceGetTemperature, getattr(pynvml, "NVML_TEMPERATURE_GPU", 0))
        power = ask(pynvml.nvmlDeviceGetPowerUsage)  # milliwatts
        limit = ask(pynvml.nvmlDeviceGetEnforcedPowerLimit)
    health = GpuHealth(
        int(util.gpu) if util is not None else None,
        int(temp) if temp is not None else None,
        power / 1000 if power is not None else None,
        limit / 1000 if limit else None,
    )
    if health.utilization is None and health.temperature is None and health.power_watts is None:
        return None
    return health


def gpu_health_fields(index: int = 0) -> dict:
    """StepMetrics' gpu_* fields for GPU `index`; {} where NVML has nothing to say."""
    health = gpu_health(index)
    return health.fields() if health is not None else {}


def _cuda_memory(index: int) -> DeviceMemory | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(index)
        return DeviceMemory(int(total - free), int(total), "cuda")
    except Exception:  # device busy or gone
        return None


def device_memory(index: int = 0, unified: bool = False, meminfo: Path | str = MEMINFO) -> DeviceMemory | None:
    """Device-wide used / total of GPU `index`; see the module docstring for the sources."""
    if unified:
        return os_memory(meminfo)
    return _nvml_memory(index) or _cuda_memory(index)
