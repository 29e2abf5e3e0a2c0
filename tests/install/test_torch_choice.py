"""Which torch build the installer picks, from nvidia-smi's answers on each kind of machine
(tests/install/data/drivers), and the same decision made by the system's bare Python through a fake
nvidia-smi on PATH (how scripts/install.sh runs it, before the project's environment exists)."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.hardware import torch_choice as tc

DATA = Path(__file__).parent / "data" / "drivers"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "engine" / "hardware" / "torch_choice.py"


def machine(case: str, arch: str = "x86_64", installed=None) -> tc.Machine:
    """The recorded machine with Python 3.12, which every build in CUDA_BUILDS has wheels for (the Python
    running the tests may be newer: see test_python_314_takes_a_torch_built_for_it)."""
    header = (DATA / f"{case}.nvidia-smi.txt").read_text()
    query = (DATA / f"{case}.query.csv").read_text()
    driver, cuda, gpus = tc.parse_nvidia_smi(header, query)
    return tc.Machine("linux", arch, driver, cuda, gpus, installed, python=(3, 12))


@pytest.mark.parametrize(
    "case, arch, build, spec, words",
    [
        # A recent driver: the newest build it runs.
        ("rtx4090-r580", "x86_64", "cu130", "torch==2.13.0+cu130", ["RTX 4090", "CUDA up to 13.0"]),
        ("rtx4070-laptop-r570", "x86_64", "cu128", "torch==2.13.0+cu128", ["CUDA up to 12.8"]),
        # An older 12.x driver: the last torch built for a CUDA it runs.
        ("rtx3090-r535", "x86_64", "cu121", "torch==2.5.1+cu121", ["CUDA up to 12.2", "torch 2.5.1 is the last"]),
        # Pascal on a new driver: cu128+ has no kernels for it.
        ("gtx1080-r580", "x86_64", "cu126", "torch==2.13.0+cu126", ["no kernels for this card's generation"]),
        # The DGX Spark: ARM, unified memory, CUDA 13.
        ("gb10-dgx-spark-r580", "aarch64", "cu130", "torch==2.13.0+cu130", ["GB10, unified memory", "13.0"]),
    ],
)
def test_cuda_build_for_the_driver(case, arch, build, spec, words):
    choice = tc.decide(machine(case, arch))
    assert (choice.action, choice.build, choice.spec) == ("install", build, spec)
    assert choice.index == tc.WHEEL_INDEX + build
    for word in words:
        assert word in choice.line()


def test_old_driver_gets_the_cpu_build_and_is_told_to_update():
    m = machine("gtx1080-r470")
    assert m.driver_version == "470.256.02" and m.driver_cuda == (11, 4)
    assert m.gpus[0].name == "NVIDIA GeForce GTX 1080" and m.gpus[0].capability is None  # R470: no compute_cap
    choice = tc.decide(m)
    assert choice.spec == "torch==2.13.0+cpu" and choice.build == "cpu"
    assert "CUDA up to 11.4" in choice.reason and "update the NVIDIA driver" in choice.reason


def test_python_314_takes_a_torch_built_for_it():
    """torch 2.9 was the first release with Python 3.14 wheels: a driver new enough for the pinned release gets
    it; one that needs 2.5.1 (the last for CUDA 12.1) gets the CPU build, told what to change for the GPU."""
    new = machine("rtx4070-laptop-r570")
    new.python = (3, 14)
    assert tc.decide(new).spec == "torch==2.13.0+cu128"
    old = machine("rtx3090-r535")
    old.python = (3, 14)
    choice = tc.decide(old)
    assert (choice.spec, choice.build) == ("torch==2.13.0+cpu", "cpu")
    for words in ("torch 2.5.1", "no build for Python 3.14", "update the NVIDIA driver", "PYTHON=python3.13"):
        assert words in choice.reason
    old.python = (3, 13)
    assert tc.decide(old).spec == "torch==2.5.1+cu121"


def test_install_sh_and_the_doctor_accept_the_same_pythons():
    """scripts/install.sh checks the version with the system Python before anything of the project runs, so it
    says the range itself; it must be SUPPORTED_PYTHON, which `tunesmith doctor` checks against."""
    text = (ROOT / "scripts" / "install.sh").read_text(encoding="utf-8")
    (lo, hi) = tc.SUPPORTED_PYTHON
    assert f"{lo} <= sys.version_info[:2] <= {hi}" in text
    words = f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    assert text.count(words) >= 2 and f"python{hi[0]}.{hi[1]} " in text  # the messages and the candidates


def test_the_environments_python_is_asked(tmp_path):
    """install.sh passes the environment's interpreter; its version, not the running one's, picks the wheel."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$2" in *torch*) echo null;; *) echo 3.14;; esac\n')
    fake.chmod(0o755)
    m = tc.read_machine(str(fake))
    assert m.python == (3, 14) and m.installed is None
    assert tc.read_machine(sys.executable).python == sys.version_info[:2]


def test_dgx_spark_reports_unified_memory():
    m = machine("gb10-dgx-spark-r580", "aarch64")
    assert m.gpus[0].memory_mib is None and m.gpus[0].capability == (12, 1)


def test_no_gpu_is_the_cpu_build_from_the_pinned_release():
    choice = tc.decide(tc.Machine("linux", "x86_64"))
    # The +cpu local version matches only the CPU build: PyPI's Linux torch is a CUDA build of several GB.
    assert choice.spec == "torch==2.13.0+cpu" and choice.index == tc.WHEEL_INDEX + "cpu"
    mac = tc.decide(tc.Machine("darwin", "arm64"))
    assert mac.spec == "torch==2.13.0" and mac.index is None


def test_a_torch_that_works_is_kept_and_a_cpu_build_on_a_gpu_is_replaced():
    works = {"version": "2.11.0+cu128", "cuda": "12.8", "cuda_works": True}
    assert tc.decide(machine("rtx4090-r580", installed=works)).action == "keep"
    cpu_build = {"version": "2.13.0+cpu", "cuda": None, "cuda_works": False}
    choice = tc.decide(machine("rtx4090-r580", installed=cpu_build))
    assert choice.action == "install" and "the installed 2.13.0+cpu cannot use it" in choice.reason
    # Without a GPU any torch that imports is kept (a CUDA build runs on the CPU too) ...
    assert tc.decide(tc.Machine(installed=cpu_build)).action == "keep"
    # ... unless it is older than the engine accepts.
    old = {"version": "2.2.1", "cuda": None, "cuda_works": False}
    assert tc.decide(tc.Machine(installed=old)).spec == "torch==2.13.0+cpu"


def _fake_smi(folder: Path, case: str) -> None:
    """An nvidia-smi that answers what the recorded one printed (the table, or the query)."""
    smi = folder / "nvidia-smi"
    table, query = DATA / f"{case}.nvidia-smi.txt", DATA / f"{case}.query.csv"
    smi.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *compute_cap*) cat {shlex.quote(str(query))};; *query-gpu*) exit 2;; '
        f"*) cat {shlex.quote(str(table))};; esac\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def _system_python() -> str:
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate and os.path.exists(candidate):
            return candidate
    pytest.skip("no system python3")


@pytest.mark.parametrize("case, spec", [("rtx4070-laptop-r570", "torch==2.13.0+cu128"), (None, "torch==2.13.0+cpu")])
def test_system_python_decides_through_nvidia_smi_on_path(tmp_path, case, spec):
    """As install.sh runs it: the bare system Python, no project installed, nvidia-smi found on PATH (or not)."""
    if case:
        _fake_smi(tmp_path, case)
    # PATH holds the fake nvidia-smi (or nothing like it) and the basic tools only; no environment's torch.
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "LD_LIBRARY_PATH": str(tmp_path)}
    out = subprocess.run(
        [_system_python(), "-I", str(SCRIPT), "--shell"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    values = dict(shlex.split(line)[0].split("=", 1) for line in out.stdout.splitlines())
    if case is None and values["TORCH_SPEC"] != spec:
        pytest.skip(f"this machine has an NVIDIA driver library: {values['TORCH_LINE']}")
    assert values["TORCH_ACTION"] == "install" and values["TORCH_SPEC"] == spec
    assert values["TORCH_LINE"].startswith(f"torch: installing {spec} (")


def test_this_environments_torch_is_kept_here():
    """On this machine (no GPU) the environment's torch stays: the installer never replaces a working build."""
    line = subprocess.run(
        [sys.executable, str(SCRIPT), "--venv-python", sys.executable], capture_output=True, text=True
    ).stdout
    if "NVIDIA" in line and "keeping" not in line:
        pytest.skip("a GPU machine whose torch does not run on its card")
    assert line.startswith("torch: keeping "), line
