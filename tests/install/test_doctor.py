"""`tunesmith doctor` as a user runs it (a child process of this environment): it passes here, and each piece
hidden at the process boundary is named with the command that fixes it.

How each piece is hidden: a module by a package of that name earlier on PYTHONPATH that raises ImportError; a
requirement by an older distribution's metadata earlier on PYTHONPATH; a system library by
TUNESMITH_HIDE_LIBS (studio.system_libs' seam, the dynamic linker's answer for every other one); llama.cpp's
converter by TUNESMITH_LLAMA_CPP_DIR pointing at an empty folder; an NVIDIA card by an nvidia-smi on PATH that
prints a recorded driver's answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from engine.doctor import GiB, check_disk, check_python
from tests.install.test_torch_choice import _fake_smi

pytestmark = pytest.mark.slow  # each run compiles a Triton kernel (interpreted here) and runs an NF4 matmul


def doctor(tmp_path: Path, hide_modules=(), old_dists=(), **env_extra) -> tuple[int, str]:
    hide = tmp_path / "hide"
    for name in hide_modules:
        (hide / name).mkdir(parents=True, exist_ok=True)
        (hide / name / "__init__.py").write_text(f"raise ImportError('{name} hidden by the test')\n")
    for name, version in old_dists:
        info = hide / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "QT_QPA_PLATFORM": "offscreen", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(hide), str(Path(__file__).resolve().parents[2])])
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-m", "studio.cli", "doctor", "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        env={k: v for k, v in env.items() if v is not None},
        timeout=900,
    )
    return out.returncode, out.stdout + out.stderr


def line_of(out: str, name: str) -> str:
    """The check's line and its fix line."""
    lines = out.splitlines()
    for i, text in enumerate(lines):
        if text[9:].startswith(name + " "):
            return "\n".join(lines[i : i + 2])
    raise AssertionError(f"no {name} line in:\n{out}")


def test_doctor_passes_here(tmp_path):
    rc, out = doctor(tmp_path)
    assert rc == 0, out
    for name in ("Python", "environment", "torch", "Triton", "bitsandbytes", "Qt", "disk"):
        assert line_of(out, name).startswith("ok "), out
    assert "a kernel compiled and ran" in line_of(out, "Triton")
    assert "an NF4 matmul ran" in line_of(out, "bitsandbytes")
    assert "ready to train" in out


def test_each_hidden_piece_is_named_with_its_fix(tmp_path):
    rc, out = doctor(
        tmp_path,
        hide_modules=("triton", "bitsandbytes"),
        old_dists=(("PyYAML", "3.10"),),
        TUNESMITH_HIDE_LIBS="libxcb-cursor.so.0",
        QT_QPA_PLATFORM=None,  # the desktop's X11 platform: its libraries are checked
        DISPLAY=":0",
        TUNESMITH_LLAMA_CPP_DIR=str(tmp_path / "no-llama"),
    )
    assert rc == 1, out
    env = line_of(out, "environment")
    assert env.startswith("MISSING") and "pyyaml 3.10 (needs >=6.0)" in env and "scripts/install.sh" in env
    triton = line_of(out, "Triton")
    assert triton.startswith("missing") and "triton hidden by the test" in triton
    bnb = line_of(out, "bitsandbytes")
    assert bnb.startswith("missing") and "bitsandbytes hidden by the test" in bnb
    qt = line_of(out, "Qt")
    assert qt.startswith("MISSING") and "libxcb-cursor.so.0" in qt and "fix: sudo apt install libxcb-cursor0" in qt
    llama = line_of(out, "llama.cpp")
    assert llama.startswith("missing") and "GGUF export is off" in llama and "TUNESMITH_GGUF=1 bash" in llama
    assert "a run needs environment, Qt" in out


def test_hidden_torch_is_named(tmp_path):
    rc, out = doctor(tmp_path, hide_modules=("torch",))
    assert rc == 1
    torch_line = line_of(out, "torch")
    assert torch_line.startswith("MISSING") and "torch hidden by the test" in torch_line, out
    assert "fix: bash " in torch_line and "scripts/install.sh" in torch_line


def test_a_card_that_the_cpu_torch_cannot_use_is_named(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_smi(bin_dir, "rtx4090-r580")
    rc, out = doctor(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine's torch runs on a real card")
    assert rc == 1, out
    assert line_of(out, "driver").startswith("ok") and "RTX 4090, driver 580.95.05" in out
    torch_line = line_of(out, "torch")
    assert "does not run on the NVIDIA GeForce RTX 4090" in torch_line and "torch==2.13.0+cu130" in torch_line
    assert "fix: bash " in torch_line


def test_disk_check_names_the_runs_folder(tmp_path):
    folder = tmp_path / "not" / "made" / "yet"
    ok = check_disk(folder, need=1)
    assert ok.ok and str(folder) in ok.detail
    full = check_disk(folder, need=1 << 60)
    assert not full.ok and full.needed and str(folder) in full.detail and f"{(1 << 60) / GiB:.0f} GiB" in full.detail


@pytest.mark.parametrize("minor, status", [(9, "fail"), (10, "ok"), (14, "ok"), (15, "fail")])
def test_the_python_check_takes_install_shs_range(monkeypatch, minor, status):
    """3.10 to 3.14, as scripts/install.sh accepts (test_torch_choice holds the script to the same range)."""
    monkeypatch.setattr(sys, "version_info", types.SimpleNamespace(major=3, minor=minor))
    check = check_python()
    assert check.status == status
    if status == "fail":
        assert check.detail.endswith("Tunesmith needs 3.10 to 3.14") and "scripts/install.sh" in check.fix
