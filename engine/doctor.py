"""`tunesmith doctor`: is everything a run needs here, and if not, the one command that fixes each piece.

One `Check` per piece: Python, the environment, torch and its CUDA, the NVIDIA driver, Triton (a tiny kernel
compiled and run; on a machine without a GPU through Triton's interpreter), bitsandbytes (an NF4 matmul),
the GGUF export's llama.cpp, free disk for runs. The Qt libraries are the studio's to check (engine never
imports Qt): studio.cli and the Hardware page add that line through `extra`.

Each check catches everything: a broken library is a finding, never a crash of the doctor. Triton and
bitsandbytes run in a child process of this interpreter, so a kernel that takes the process down (or a
library that cannot be imported twice) is reported too, and what each child imports is this environment's
as the run would see it. A check is `needed` when a run cannot do without it on this machine; `report()`'s
exit status is 1 when a needed check failed.

The module imports the standard library only at the top: scripts/env_check.py loads it by file path to
decide whether the project's environment is complete before Tunesmith imports at all.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from engine.hardware import torch_choice  # the standard library only, like this module

GiB = 1024**3
# Below this a run cannot save its checkpoints (the demo's are a few MB; a 8B adapter's with AdamW state ~1 GiB).
MIN_FREE_DISK = 2 * GiB
# Below this a merged 16-bit export of an 8B model (~16 GiB) will not fit: said, not failed.
ROOMY_DISK = 20 * GiB
MARKER = "tunesmith-install.txt"  # written by scripts/install.sh after a complete install
CHILD_TIMEOUT = 300


@dataclass
class Check:
    name: str
    status: str  # "ok", "fail" (something is wrong) or "n/a" (does not apply to this machine)
    detail: str  # what was found, or what is wrong
    fix: str = ""  # the one command that fixes it
    needed: bool = True  # a run needs it here: a failure makes the exit status 1

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def line(self) -> str:
        label = {"ok": "ok", "n/a": "n/a"}.get(self.status, "MISSING" if self.needed else "missing")
        text = f"{label:<8} {self.name:<14} {self.detail}"
        if self.fix and self.status == "fail":
            text += f"\n{'':<8} {'':<14} fix: {self.fix}"
        return text


# -- where this is running ----------------------------------------------------------------------


def checkout_root() -> Path | None:
    """The checkout this engine is installed from (editable), None for a wheel install or the bundle."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "scripts" / "install.sh").is_file() else None


def frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def install_fix(what: str = "") -> str:
    """The one command that (re)installs a missing piece in this kind of install."""
    root = checkout_root()
    if root is not None:
        prefix = "" if what != "gguf" else "TUNESMITH_GGUF=1 "
        return f"{prefix}bash {root / 'scripts' / 'install.sh'}"
    if frozen():
        if what == "gguf":  # the bundle leaves llama.cpp out (a C++ build per machine)
            return "not in the bundle: GGUF export runs from a checkout (TUNESMITH_GGUF=1 bash scripts/install.sh)"
        return "download the bundle again (a file of it is missing)"
    spec = {"gguf": "'tunesmith[gguf]'", "": "tunesmith"}.get(what, what)
    return f"{sys.executable} -m pip install {spec}"


def _child(code: str, timeout: int = CHILD_TIMEOUT, env: dict | None = None) -> tuple[bool, str]:
    """Run `code` as a file (Triton's @jit reads its kernel's source) in a child of this interpreter; (ok, the
    last line it printed, or the last line of its error)."""
    if frozen():
        return False, "not available in the bundle"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "doctor_child.py"
        script.write_text(code, encoding="utf-8")
        try:
            out = subprocess.run(
                [sys.executable, str(script)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired:
            return False, f"no answer in {timeout} s"
    lines = [x for x in (out.stdout if out.returncode == 0 else out.stderr or out.stdout).splitlines() if x.strip()]
    if out.returncode != 0:
        return False, lines[-1] if lines else f"the check exited with status {out.returncode}"
    return True, lines[-1] if lines else ""


# -- the checks ---------------------------------------------------------------------------------


def check_python() -> Check:
    v = sys.version_info
    found = f"{platform.python_version()} ({sys.executable})"
    lo, hi = torch_choice.SUPPORTED_PYTHON
    if lo <= (v.major, v.minor) <= hi:
        return Check("Python", "ok", found)
    need = "%d.%d to %d.%d" % (*lo, *hi)
    return Check("Python", "fail", f"{found}: Tunesmith needs {need}", "PYTHON=python3.12 " + install_fix())


def requirement_problems(extras: Iterable[str] = ()) -> list[str]:
    """Requirements of the installed tunesmith (and of `extras`) that are missing or at a wrong version."""
    from importlib import metadata

    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging (not installed)"]
    try:
        reqs = metadata.requires("tunesmith") or []
    except metadata.PackageNotFoundError:
        return ["tunesmith (not installed)"]
    found = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None:
            marker_env = default_environment()
            if not any(req.marker.evaluate({**marker_env, "extra": e}) for e in ["", *extras]):
                continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            found.append(f"{req.name} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            found.append(f"{req.name} {have} (needs {req.specifier})")
    return found


def check_environment() -> Check:
    if frozen():
        return Check("environment", "ok", f"the bundle in {Path(sys.executable).parent}")
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    where = f"{sys.prefix}" if in_venv else f"no virtual environment ({sys.prefix})"
    missing = requirement_problems()
    if missing:
        return Check("environment", "fail", f"{where}: missing {', '.join(missing)}", install_fix())
    marker = Path(sys.prefix) / MARKER
    root = checkout_root()
    if root is not None and not marker.is_file():
        # Imports work, but scripts/install.sh never finished here: it finishes what is left.
        return Check("environment", "fail", f"{where}: no record of a complete install", install_fix(), needed=False)
    done = f", {marker.read_text(encoding='utf-8').strip()}" if marker.is_file() else ""
    return Check("environment", "ok", f"{where}{done}")


def check_torch_and_driver() -> list[Check]:
    machine = torch_choice.read_machine()
    gpu = machine.gpus[0] if machine.gpus else None
    if gpu is None or machine.driver_cuda is None:
        driver = Check("driver", "n/a", "no NVIDIA GPU or driver found: training runs on the CPU", needed=False)
    else:
        cuda = f"{machine.driver_cuda[0]}.{machine.driver_cuda[1]}"
        driver = Check("driver", "ok", f"{gpu.name}, driver {machine.driver_version or '?'} (runs CUDA up to {cuda})")
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken install
        machine.installed = None
        fix = install_fix() if checkout_root() or frozen() else _pip_torch(torch_choice.decide(machine))
        return [Check("torch", "fail", f"does not import ({type(exc).__name__}: {exc})", fix), driver]
    version = torch.__version__
    if gpu is None or machine.driver_cuda is None:
        return [
            Check("torch", "ok", f"{version} (CPU{'; CUDA ' + torch.version.cuda if torch.version.cuda else ''})"),
            driver,
        ]
    works = False
    try:
        works = torch.cuda.is_available() and float((torch.ones(2, device="cuda") * 2).sum().item()) == 4.0
    except Exception:  # noqa: BLE001 - a build without this card's kernels raises here
        works = False
    if works:
        name = torch.cuda.get_device_name(0)
        return [Check("torch", "ok", f"{version}, CUDA {torch.version.cuda}, runs on {name}"), driver]
    machine.installed = {"version": version, "cuda": torch.version.cuda, "cuda_works": False}
    choice = torch_choice.decide(machine)
    what = "a CPU build" if not torch.version.cuda else f"built for CUDA {torch.version.cuda}"
    detail = f"{version} is {what} and does not run on the {gpu.name}; {choice.line()}"
    fix = install_fix() if checkout_root() else _pip_torch(choice)
    return [Check("torch", "fail", detail, fix), driver]


def _pip_torch(choice) -> str:
    index = f" --extra-index-url {choice.index}" if choice.index else ""
    return f"{sys.executable} -m pip install '{choice.spec}'{index}"


def _cuda_ready() -> bool:
    try:
        torch = importlib.import_module("torch")
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


TRITON_KERNEL = """
import torch
import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.arange(100, dtype=torch.float32, device=device)
out = torch.empty_like(x)
add[(triton.cdiv(100, 64),)](x, x, out, 100, BLOCK=64)
assert torch.equal(out, 2 * x), "the kernel computed a wrong sum"
print(f"Triton {triton.__version__}: a kernel compiled and ran on {device}")
"""


def check_triton() -> Check:
    if importlib.util.find_spec("triton") is None:
        gpu = _cuda_ready()
        return Check(
            "Triton",
            "fail",
            "not installed" + ("" if gpu else " (the CPU runs the torch references; tests use its interpreter)"),
            install_fix(),
            needed=gpu,
        )
    gpu = _cuda_ready()
    if frozen() and not gpu:
        return Check("Triton", "n/a", "no GPU: the torch references run", needed=False)
    env = {} if gpu else {"TRITON_INTERPRET": "1"}
    ok, said = _child(TRITON_KERNEL, env=env)
    if ok:
        return Check("Triton", "ok", said + ("" if gpu else " (interpreter: no GPU, the torch references train)"))
    fix = install_fix() if gpu else install_fix()
    return Check("Triton", "fail", f"a tiny kernel did not run: {said}", fix, needed=gpu)


BNB_MATMUL = """
import torch
import bitsandbytes as bnb
from bitsandbytes.functional import dequantize_4bit, quantize_4bit

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
torch.manual_seed(0)
w = torch.randn(128, 64, dtype=dtype, device=device)
q, state = quantize_4bit(w, quant_type="nf4")
x = torch.randn(4, 64, dtype=dtype, device=device)
y = bnb.matmul_4bit(x, q.t(), quant_state=state)
ref = x @ dequantize_4bit(q, state).t()
err = (y.float() - ref.float()).abs().max().item()
assert err < 0.05 * ref.float().abs().max().item() + 1e-3, f"NF4 matmul is off by {err}"
print(f"bitsandbytes {bnb.__version__}: an NF4 matmul ran on {device}")
"""


def check_bitsandbytes() -> Check:
    gpu = _cuda_ready()
    if sys.platform == "darwin":
        return Check("bitsandbytes", "n/a", "macOS: QLoRA (4-bit) is not offered", needed=False)
    if importlib.util.find_spec("bitsandbytes") is None:
        return Check("bitsandbytes", "fail", "not installed: QLoRA (4-bit) is off", install_fix(), needed=gpu)
    if frozen():
        return Check(
            "bitsandbytes", "n/a", "installed in the bundle (its matmul is checked from an environment)", needed=False
        )
    ok, said = _child(BNB_MATMUL)
    if ok:
        return Check("bitsandbytes", "ok", said)
    return Check("bitsandbytes", "fail", f"an NF4 matmul did not run: {said}", install_fix(), needed=gpu)


def check_gguf() -> Check:
    try:
        from engine.export import gguf

        missing = gguf.missing()
    except Exception as exc:  # noqa: BLE001
        missing = [f"the GGUF exporter ({type(exc).__name__}: {exc})"]
    if not missing:
        return Check("llama.cpp", "ok", "GGUF export ready (llama-cpp-python and llama.cpp's converter)", needed=False)
    return Check(
        "llama.cpp",
        "fail",
        f"GGUF export is off: missing {', '.join(missing)} (adapter and merged exports work)",
        install_fix("gguf"),
        needed=False,
    )


def check_disk(runs_dir: str | os.PathLike | None = None, need: int = MIN_FREE_DISK) -> Check:
    folder = Path(runs_dir or Path.home() / "Tunesmith" / "runs").expanduser()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the folder is made by the first run: its nearest existing parent holds it
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return Check("disk", "fail", f"cannot read free space of {probe}: {exc}", f"mkdir -p {folder}")
    text = f"{free / GiB:.1f} GiB free for runs in {folder}"
    if free < need:
        return Check(
            "disk",
            "fail",
            f"{text}; a run needs at least {need / GiB:.0f} GiB",
            "tunesmith --runs-dir /a/folder/with/room (or free space there)",
        )
    if free < ROOMY_DISK:
        text += " (a merged 16-bit export of an 8B model needs ~16 GiB)"
    return Check("disk", "ok", text)


def run_checks(runs_dir=None, extra: Iterable[Callable[[], Check]] = ()) -> list[Check]:
    """Every check, in the order they are printed."""
    checks = [check_python(), check_environment(), *check_torch_and_driver(), check_triton(), check_bitsandbytes()]
    checks += [fn() for fn in extra]
    checks += [check_gguf(), check_disk(runs_dir)]
    return checks


def report(checks: list[Check], out=print) -> int:
    """Print one line per check (and its fix); 1 when something a run needs is missing."""
    for check in checks:
        out(check.line())
    failed = [c for c in checks if not c.ok and c.needed]
    if failed:
        out(f"tunesmith doctor: a run needs {', '.join(c.name for c in failed)}: run the fix above")
        return 1
    optional = [c.name for c in checks if not c.ok]
    out("tunesmith doctor: ready to train" + (f" ({', '.join(optional)} optional, off)" if optional else ""))
    return 0
