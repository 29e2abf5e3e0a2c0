"""The headless command line: train, export, hw, through real subprocesses."""

import subprocess
import sys

import pytest
import yaml

from engine.resources import DEMO_PRESET


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # trains and exports in child processes
def test_train_then_export_from_the_command_line(tmp_path):
    cfg = yaml.safe_load(DEMO_PRESET.read_text())
    cfg["data"]["max_examples"] = 30
    cfg["data"]["max_seq_len"] = 128
    cfg["training"]["max_steps"] = 2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = cli("train", str(path), "--output", str(run_dir))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 2/2" in out.stdout and "finished" in out.stdout
    out = cli("export", str(run_dir), "--adapter", str(tmp_path / "adapter"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    # The same folder again is refused rather than overwritten.
    again = cli("train", str(path), "--output", str(run_dir))
    assert again.returncode == 1 and "already holds a run" in again.stderr


def test_bad_config_is_reported_with_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  lr: fast\n")
    out = cli("train", str(path))
    assert out.returncode == 2
    assert "training.lr" in out.stderr


def test_hw_prints_the_profile_and_defaults():
    out = cli("hw", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cpu" in out.stdout.lower()
