"""Which torch build to install: the CUDA build that this machine's NVIDIA driver can run, or the CPU build.

scripts/install.sh runs this file with the system's Python before the project's environment exists, so it
imports the standard library only (no torch, no engine): `python3 engine/hardware/torch_choice.py --shell
--venv-python .venv/bin/python` prints shell assignments (TORCH_ACTION, TORCH_SPEC, TORCH_INDEX,
TORCH_REASON) for the script to eval. `tunesmith doctor` imports it for the same decision.

`decide()` is pure: it takes what `nvidia-smi` printed (its header names the highest CUDA version the
driver runs), libcuda's cuDriverGetVersion as a fallback, the CPU architecture and the torch already in
the environment, so the tests feed it recorded driver outputs. An installed torch that already works with
the card (or, without a card, imports) is kept: replacing a working multi-GB build helps nobody.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

# The Pythons Tunesmith runs on, oldest and newest; scripts/install.sh's version_ok says the same (a test in
# tests/install holds the two together) and `tunesmith doctor` checks against this.
SUPPORTED_PYTHON = ((3, 10), (3, 14))
# The torch release this project pins and tests (scripts/install.sh installs this one).
TORCH_VERSION = "2.13.0"
# The oldest torch the engine accepts (pyproject.toml: torch>=2.4).
MIN_TORCH = (2, 4)
WHEEL_INDEX = "https://download.pytorch.org/whl/"

# CUDA builds, newest first: (wheel tag, CUDA version the driver must run, torch release that has it).
# A driver runs every build up to the CUDA version its nvidia-smi header names. torch 2.13.0 ships cu126,
# cu128 and cu130; older drivers get the last torch release built for their CUDA.
CUDA_BUILDS: tuple[tuple[str, tuple[int, int], str], ...] = (
    ("cu130", (13, 0), TORCH_VERSION),
    ("cu128", (12, 8), TORCH_VERSION),
    ("cu126", (12, 6), TORCH_VERSION),
    ("cu124", (12, 4), "2.6.0"),
    ("cu121", (12, 1), "2.5.1"),
    ("cu118", (11, 8), "2.7.1"),
)
# torch's cu128 and newer builds dropped Maxwell, Pascal and Volta (compute capability below 7.5);
# cu126 is the newest build with their kernels. Builds before cu128 have none for Blackwell (10.0, 12.x).
NEWEST_FOR_OLD_CARDS = "cu126"
OLDEST_FOR_BLACKWELL = "cu128"
# CUDA wheels for 64-bit ARM (DGX Spark's GB10, Grace) start at cu128.
OLDEST_FOR_ARM = "cu128"
MIN_CAPABILITY = (5, 0)
# The newest Python each torch release has wheels for (checked on PyPI: 2.9 was the first with cp314).
# A driver that needs one of the older releases cannot get a CUDA build for a newer Python.
NEWEST_PYTHON = {TORCH_VERSION: (3, 14), "2.7.1": (3, 13), "2.6.0": (3, 13), "2.5.1": (3, 13)}


@dataclass
class Gpu:
    name: str
    capability: tuple[int, int] | None = None
    memory_mib: int | None = None  # None: the driver reports none of its own (unified memory)


@dataclass
class Machine:
    """What the decision reads: the driver's answers, the platform, and the torch already installed."""

    system: str = "linux"  # sys.platform's spelling: linux, win32, darwin
    arch: str = "x86_64"
    driver_version: str | None = None
    driver_cuda: tuple[int, int] | None = None  # the highest CUDA version the driver runs
    gpus: list[Gpu] = field(default_factory=list)
    installed: dict | None = None  # probe_installed()'s answer, None when no torch imports
    python: tuple[int, int] = sys.version_info[:2]  # the environment's Python, which the wheel must match


@dataclass
class Choice:
    action: str  # "keep" or "install"
    spec: str  # the pip requirement, e.g. torch==2.13.0+cu128
    index: str | None  # the wheel index to add (pip --extra-index-url), None for the configured ones
    build: str  # "cpu", "cu128", ... or the installed torch's version for "keep"
    reason: str  # one line: what and why

    def line(self) -> str:
        verb = "keeping" if self.action == "keep" else "installing"
        return f"torch: {verb} {self.spec if self.action == 'install' else self.build} ({self.reason})"


# -- reading the driver -------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_nvidia_smi(header: str, query: str = "") -> tuple[str | None, tuple[int, int] | None, list[Gpu]]:
    """Driver version, the driver's CUDA version and the GPUs from `nvidia-smi`'s table (`header`) and from
    `nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits` (`query`; drivers
    before R510 know no compute_cap and answer the first two fields only)."""
    driver = re.search(r"Driver Version:\s*([0-9.]+)", header or "")
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", header or "")
    gpus = []
    for row in (query or "").splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) < 2 or not parts[0]:
            continue
        memory = parts[1].split()[0] if parts[1] else ""
        capability = parse_version(parts[2]) if len(parts) > 2 else None
        gpus.append(Gpu(parts[0], capability, int(memory) if memory.isdigit() else None))
    return (driver.group(1) if driver else None), (parse_version(cuda.group(1)) if cuda else None), gpus


def libcuda_version() -> tuple[int, int] | None:
    """cuDriverGetVersion from the driver library itself (when nvidia-smi is not on PATH)."""
    names = {"win32": ["nvcuda.dll"], "darwin": []}.get(sys.platform, ["libcuda.so.1", "libcuda.so"])
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return version.value // 1000, (version.value % 1000) // 10
    return None


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def read_machine(venv_python: str | None = None) -> Machine:
    """This machine, as decide() reads it."""
    machine = Machine(system=sys.platform, arch=platform.machine().lower())
    smi = shutil.which("nvidia-smi")
    if smi:
        header = _run([smi])
        fields = "--format=csv,noheader,nounits"
        query = _run([smi, "--query-gpu=name,memory.total,compute_cap", fields])
        query = query or _run([smi, "--query-gpu=name,memory.total", fields])  # drivers before R510
        machine.driver_version, machine.driver_cuda, machine.gpus = parse_nvidia_smi(header, query)
    if machine.driver_cuda is None:
        machine.driver_cuda = libcuda_version()
    if machine.driver_cuda and not machine.gpus:
        machine.gpus = [Gpu("NVIDIA GPU (nvidia-smi named none)")]
    if venv_python:
        machine.installed = probe_installed(venv_python)
        machine.python = parse_version(_run([venv_python, "-c", PYTHON_PROBE])) or machine.python
    return machine


# What the environment's torch is, asked of the environment's own interpreter.
PROBE = """
import json
try:
    import torch
except Exception as exc:
    print(json.dumps(None)); raise SystemExit
works = False
if torch.cuda.is_available():
    try:
        works = float((torch.ones(2, device="cuda") * 2).sum().item()) == 4.0
    except Exception:
        works = False
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda, "cuda_works": works}))
"""


PYTHON_PROBE = "import sys; print('%d.%d' % sys.version_info[:2])"


def probe_installed(python: str) -> dict | None:
    text = _run([python, "-c", PROBE]).strip().splitlines()
    try:
        return json.loads(text[-1]) if text else None
    except ValueError:
        return None


# -- the decision -------------------------------------------------------------------------------


def _cpu(machine: Machine, why: str) -> Choice:
    if machine.system.startswith("linux"):
        # PyPI's Linux torch is a CUDA build of several GB; the +cpu pin matches the CPU build only.
        return Choice("install", f"torch=={TORCH_VERSION}+cpu", WHEEL_INDEX + "cpu", "cpu", why)
    return Choice("install", f"torch=={TORCH_VERSION}", None, "cpu", why)  # PyPI's macOS/Windows torch is the CPU one


def _tag_index(tag: str) -> int:
    return [b[0] for b in CUDA_BUILDS].index(tag)


def decide(machine: Machine) -> Choice:
    """The torch build for `machine`, with a one-line reason."""
    gpus = machine.gpus
    installed = machine.installed
    if installed and tuple(int(x) for x in re.findall(r"\d+", installed["version"])[:2]) < MIN_TORCH:
        installed = None  # too old for the engine: replaced below
    if not gpus or machine.driver_cuda is None:
        if installed:
            return Choice(
                "keep", "", None, installed["version"], "no NVIDIA GPU here; the installed torch runs on the CPU"
            )
        return _cpu(machine, "no NVIDIA GPU or driver found: the CPU build")
    gpu = gpus[0]
    unified = gpu.memory_mib is None or "GB10" in gpu.name
    where = f"{gpu.name}{', unified memory' if unified else ''}, driver {machine.driver_version or '?'}"
    cuda = f"{machine.driver_cuda[0]}.{machine.driver_cuda[1]}"
    if installed and installed.get("cuda_works"):
        return Choice("keep", "", None, installed["version"], f"it already runs on the {where}")
    if machine.system == "darwin":
        return _cpu(machine, "macOS: torch has no CUDA build there")
    if gpu.capability and gpu.capability < MIN_CAPABILITY:
        return _cpu(
            machine,
            f"the {where} has compute capability {gpu.capability[0]}.{gpu.capability[1]}; "
            "torch's CUDA builds need 5.0 or newer: the CPU build",
        )
    usable = [b for b in CUDA_BUILDS if b[1] <= machine.driver_cuda]
    notes = []
    if gpu.capability and gpu.capability < (7, 5):
        usable = [b for b in usable if _tag_index(b[0]) >= _tag_index(NEWEST_FOR_OLD_CARDS)]
        notes.append("cu128 and newer have no kernels for this card's generation")
    needs = None
    if gpu.capability and gpu.capability >= (10, 0):
        needs = OLDEST_FOR_BLACKWELL
    if machine.arch in ("aarch64", "arm64"):
        needs = OLDEST_FOR_ARM
    if needs:
        usable = [b for b in usable if _tag_index(b[0]) <= _tag_index(needs)]
    if not usable:
        floor = needs or CUDA_BUILDS[-1][0]
        floor_cuda = CUDA_BUILDS[_tag_index(floor)][1]
        return _cpu(
            machine,
            f"the {where} runs CUDA up to {cuda} but this card needs a {floor} build (CUDA "
            f"{floor_cuda[0]}.{floor_cuda[1]}); update the NVIDIA driver to train on the GPU; the CPU build for now",
        )
    py = f"{machine.python[0]}.{machine.python[1]}"
    for_python = [b for b in usable if machine.python <= NEWEST_PYTHON.get(b[2], (3, 99))]
    if not for_python:
        tag, _, version = usable[0]
        newest = NEWEST_PYTHON[version]
        return _cpu(
            machine,
            f"the {where} runs CUDA up to {cuda}, and torch {version}, the last release built for it ({tag}), "
            f"has no build for Python {py}; to train on the GPU, update the NVIDIA driver, or make the "
            f"environment from Python {newest[0]}.{newest[1]} or older (rm -rf .venv; "
            f"PYTHON=python{newest[0]}.{newest[1]} bash scripts/install.sh); the CPU build for now",
        )
    tag, _, version = for_python[0]
    why = f"the {where} runs CUDA up to {cuda}"
    if installed and installed.get("version", "").endswith("+cpu"):
        why += f"; the installed {installed['version']} cannot use it"
    if notes:
        why += "; " + "; ".join(notes)
    if version != TORCH_VERSION:
        why += f"; torch {version} is the last release built for it (update the driver for torch {TORCH_VERSION})"
    return Choice("install", f"torch=={version}+{tag}", WHEEL_INDEX + tag, tag, why)


def shell_lines(choice: Choice) -> str:
    values = {
        "TORCH_ACTION": choice.action,
        "TORCH_SPEC": choice.spec,
        "TORCH_INDEX": choice.index or "",
        "TORCH_LINE": choice.line(),
    }
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Which torch build this machine should use, and why.")
    p.add_argument("--venv-python", help="the environment's interpreter, asked which torch it has")
    p.add_argument("--shell", action="store_true", help="print shell assignments for scripts/install.sh")
    args = p.parse_args(argv)
    choice = decide(read_machine(args.venv_python))
    print(shell_lines(choice) if args.shell else choice.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
