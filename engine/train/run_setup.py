"""The session's first setup step: what the run is and where it lives.

`configure` applies the hardware defaults to the config, picks the objective `training.method`
names, the device and the distributed plan, chooses the run folder (`plan_run_folder`: chosen, not
made), finds the adapter to start from and sets the seeds. `open_run_folder` makes the folder later,
once the data is known good (bad data fails before a folder exists): it removes what a write cut
short left, locks the folder and opens the run's files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from engine.config import ConfigError, RunConfig
from engine.runs import RunFolder, RunFolderError, new_run_folder
from engine.train.distributed import DistContext, share_from_main
from engine.train.objectives import objective_for


@dataclass
class RunSetup:
    """What `configure` decided: the config with its defaults, and what the run is made of."""

    config: RunConfig
    profile: Any  # engine.hardware.profile.HardwareProfile
    objective: Any  # engine.train.objectives.base.Objective
    device: Any  # torch.device
    fsdp: bool  # FSDP2 over several processes (engine.train.fsdp)
    folder: RunFolder
    folder_note: str  # why the name differs from the one asked for ("" when it does not)
    init_adapter: Optional[Path]  # lora.init_adapter found on disk (None on a resume)


def configure(
    config: RunConfig,
    dist: DistContext,
    resume_from: Optional[Path],
    run_dir: Optional[Path],
    disk_free: Optional[Callable],
) -> RunSetup:
    """Hardware defaults applied to the config, the objective, seeds set, the run folder chosen
    (not made). `disk_free`: a test's stand-in for the free-space reading, or None."""
    import torch

    from engine.hardware import policy
    from engine.hardware.profile import cap_to_emulated_card, detect

    profile = detect()
    cap_to_emulated_card()  # an emulated laptop card (TUNESMITH_EMULATE_GPU): this run's own cap
    # Model shape from a config.json already on disk (never a download): the memory-based
    # defaults need it; without it the policy keeps to what it can decide safely.
    info = policy.model_info_for(config)
    config = policy.apply_defaults(config, profile, info, dist.world_size)
    # What the run learns (training.method): the session asks it and never tests which it is.
    objective = objective_for(config)
    # FSDP2 for a base over one card (engine.train.fsdp); one process ignores the setting. Its
    # refusals come before the process group is joined: every rank raises the same, none waits.
    fsdp = dist.enabled and config.training.distributed == "fsdp"
    if fsdp and config.model.load_in_4bit is True:
        from engine.config import FSDP_4BIT_REFUSAL

        raise ConfigError("training.distributed", FSDP_4BIT_REFUSAL)
    if fsdp and info is not None:  # a config.json not at hand: engine.train.fsdp.shard checks after loading
        from engine.train.fsdp import alone_refusal

        why = alone_refusal(info.model_type, config.fast_paths.packed_attention is not False)
        if why and "training.distributed" in config.auto_fields:
            # The policy chose fsdp because the base does not fit one GPU: its reason says that too.
            why = f"auto chose fsdp: {config.auto_reasons['training.distributed']}"
        if why:
            raise ConfigError("training.distributed", why)
    device = torch.device(dist.device(config.training.device))
    dist.init(device)
    why = dist.check_plan(config.training.grad_accum)
    if why:
        raise ConfigError(why)
    folder, note = plan_run_folder(config, dist, resume_from, run_dir, disk_free)
    # An earlier adapter to start from (lora.init_adapter), found before the run folder is made;
    # a resume takes its adapter from the checkpoint instead.
    init_adapter = None
    if config.lora.init_adapter.strip() and resume_from is None:
        from engine.peft_model import init_adapter_path

        init_adapter = init_adapter_path(config.lora.init_adapter)
    torch.manual_seed(config.training.seed)
    random.seed(config.training.seed)
    return RunSetup(config, profile, objective, device, fsdp, folder, note, init_adapter)


def plan_run_folder(
    config: RunConfig,
    dist: DistContext,
    resume_from: Optional[Path],
    run_dir: Optional[Path],
    disk_free: Optional[Callable],
) -> tuple[RunFolder, str]:
    """Where the run will live, and a note when its name is not the one asked for. Refuses a
    folder given by path that already holds a run (no silent overwrite) and, before anything
    loads, a place where nothing can be written. A name from the config that is taken gets the
    next free one (engine.runs.new_run_folder)."""
    note = ""
    if resume_from is not None:
        folder = RunFolder.of(resume_from)
        if dist.is_main and folder.trained_elsewhere():
            # Two processes appending to one run's files and checkpoints would corrupt both.
            raise RunFolderError(
                f"{folder.path} is being trained by another process (its running.lock names a live one): "
                "stop that run first, or resume it from the window that runs it"
            )
        if dist.is_main:
            folder.check_writable(disk_free)
        return folder, note
    if run_dir is not None:
        folder = RunFolder(run_dir)
    else:
        out, path = config.output, None
        if dist.is_main:  # rank 0 picks the name (its clock, the folders it sees)
            folder, note = new_run_folder(out.dir, out.run_name, out.overwrite)
            path = str(folder.path)
        folder = RunFolder(share_from_main(dist, path))  # every rank takes it
    if dist.is_main:  # the others would see rank 0's new folder
        folder.check_free(config.output.overwrite, disk_free)
    return folder, note


def open_run_folder(folder: RunFolder, dist: DistContext, fresh: bool, reporter, on_locked: Callable[[], None]) -> Path:
    """Make the run folder (rank 0; the others wait until it exists), lock it and append the
    run's events to its files. `on_locked` is called as soon as the lock is taken, so that a
    failure after it still unlocks. Returns the folder's path."""
    from engine.train import checkpoint as ckpt

    if not dist.is_main:  # rank 0 alone writes the run folder
        dist.barrier()  # ... and has made it
        return folder.path
    made = folder.create(fresh=fresh)
    # Before anything is written: a write cut short by a full disk left these, and on a
    # disk that is still nearly full they hold the room the resume needs.
    removed = ckpt.remove_partials(made)
    made.lock()  # "running" on the Runs page while this process lives (removed in the session's close)
    on_locked()
    reporter.open_files(made)
    dist.barrier()
    for p in removed:
        reporter.log(f"Removed {p.name}, left behind by a write that did not finish")
    return made.path
