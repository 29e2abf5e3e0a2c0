"""The session's first setup step on its own (engine.train.run_setup): the config's defaults, the
objective, the device and the seed, the run folder chosen before anything loads and opened after
the data."""

import pytest
import torch

from engine.config import ConfigError, RunConfig
from engine.resources import DEMO_PRESET
from engine.runs import TMP_SUFFIX, RunFolder, RunFolderError
from engine.train.distributed import DistContext
from engine.train.reporting import Reporter
from engine.train.run_setup import configure, open_run_folder, plan_run_folder


def demo(tmp_path, name="first"):
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.output.dir = str(tmp_path)
    cfg.output.run_name = name
    return cfg


def test_configure_applies_the_defaults_and_chooses_a_folder_it_does_not_make(tmp_path):
    cfg = demo(tmp_path)
    cfg.training.seed = 1234
    cfg.training.device = "cpu"  # the same on a machine with a GPU
    torch.manual_seed(0)
    setup = configure(cfg, DistContext(), None, None, None)
    assert setup.device == torch.device("cpu")
    assert setup.config.model.dtype == "float32" and "model.dtype" in setup.config.auto_fields  # the policy's
    assert cfg.model.dtype == "auto"  # the caller's config is left as it was
    assert setup.objective.name == "sft" and setup.fsdp is False and setup.init_adapter is None
    assert setup.folder.path == tmp_path / "first" and setup.folder_note == ""
    assert not setup.folder.path.exists()  # chosen, not made: bad data must fail before it exists
    assert torch.initial_seed() == 1234


def test_a_taken_name_gets_the_next_one_and_a_folder_given_by_path_is_refused(tmp_path):
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "notes.txt").write_text("mine")
    cfg = demo(tmp_path)
    folder, note = plan_run_folder(cfg, DistContext(), None, None, None)
    assert folder.path == tmp_path / "first-2"
    assert note == f"{tmp_path / 'first'} already is in the way: this run is first-2"
    with pytest.raises(RunFolderError):  # a path is taken as given: never a silent overwrite
        plan_run_folder(cfg, DistContext(), None, tmp_path / "first", None)


def test_a_missing_init_adapter_fails_naming_the_field_before_any_folder(tmp_path):
    cfg = demo(tmp_path / "runs")
    cfg.lora.init_adapter = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="lora.init_adapter"):
        configure(cfg, DistContext(), None, None, None)
    assert not (tmp_path / "runs").exists()


def test_opening_makes_locks_and_clears_what_a_cut_short_write_left(tmp_path):
    # A run folder being resumed, with a checkpoint a full disk cut short.
    folder = RunFolder(tmp_path / "run")
    folder.checkpoints_dir.mkdir(parents=True)
    partial = folder.checkpoints_dir / f"step-3{TMP_SUFFIX}"
    partial.mkdir()
    (partial / "optimizer.pt").write_bytes(b"half")
    events, locked = [], []
    reporter = Reporter(events.append)
    path = open_run_folder(folder, DistContext(), False, reporter, lambda: locked.append(folder.lock_file.exists()))
    reporter.close()
    assert path == folder.path and locked == [True]  # told as soon as the lock is there
    assert folder.lock_file.is_file() and not partial.exists()
    said = f"Removed {partial.name}, left behind by a write that did not finish"
    assert [e.message for e in events] == [said]
    assert said in folder.log.read_text()  # the run's files were open before it was said
    folder.unlock()
