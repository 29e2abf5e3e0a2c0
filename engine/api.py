"""The engine's public names: the only ones studio/ and the CLI import (a contract, enforced by
import-linter in pyproject.toml). docs/ENGINE_API.md, first section, describes each of them.

Importing this module does not import torch, transformers, datasets or peft, so the window opens
fast: the modules imported at the top are torch-free (they import heavy libraries inside the
functions that need them), and the few names whose modules import torch at the top are lazy
(`describe_fast_paths` and `cli_main` are small wrappers; `TrainingSession` is resolved on first
use through the module's `__getattr__`). `warm_up()` imports what a run needs ahead of time.
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING, Any

# -- the process: the CUDA allocator's setting, made by entry points (engine.allocator) -------
from engine import __version__ as VERSION
from engine.allocator import prefer_expandable_segments

# -- chat --------------------------------------------------------------------------------------
from engine.chat import (
    ChatError,
    RunChat,
    generate_reply,
    load_chat_model,
    load_tools,
    template_uses_tools,
    tool_name,
)

# -- config ------------------------------------------------------------------------------------
from engine.config import (
    AUTO,
    ConfigError,
    DataConfig,
    FastPathConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    TrainingConfig,
)

# -- fast paths: what ran --------------------------------------------------------------------
from engine.counters import requested_but_not_run
from engine.data import shown_row
from engine.data.preview import (
    METHOD_DATA,
    DataPreview,
    PackingLayout,
    RenderedExample,
    load_preview,
    packing_layout,
    render_example,
)
from engine.data.scan import PACKING_SAMPLE, Cancelled, packing_scan, xray_scan
from engine.data.sources import SUFFIX_WORDS as DATA_FILE_WORDS
from engine.data.sources import SUFFIXES as DATA_FILE_SUFFIXES
from engine.data.sources import DataError
from engine.data.xray import KINDS as DATA_FINDINGS
from engine.data.xray import XRay, xray

# -- doctor: is everything a run needs here (`tunesmith doctor`, the Hardware page) --------------
from engine.doctor import Check as DoctorCheck
from engine.doctor import install_fix as doctor_install_fix
from engine.doctor import report as doctor_report
from engine.doctor import run_checks as doctor_checks

# -- events ------------------------------------------------------------------------------------
from engine.events import (
    CheckpointSaved,
    CompletionSamples,
    DiskFull,
    EvalMetrics,
    Event,
    Failed,
    Finished,
    GalleryAnswers,
    LogLine,
    MemoryAdjusted,
    Paused,
    PreflightResult,
    Resumed,
    RolledBack,
    RunStarted,
    StepMetrics,
    event_from_dict,
)

# -- export ------------------------------------------------------------------------------------
from engine.export import (
    EXPORTERS,
    ExportError,
    ExportKind,
    ExportOption,
    ExportResult,
    SelfCheckFailed,
    destinations,
    export_adapter,
    export_and_check,
    export_merged,
    find_adapter,
    read_export_report,
    run_config_for,
    run_exports,
)
from engine.export.gguf import QUANTS as GGUF_QUANTS
from engine.export.gguf import install_extra as install_gguf_extra
from engine.export.gguf import missing as gguf_missing
from engine.export.hub import push as push_to_hub
from engine.hardware.policy import apply_defaults, explain_defaults, format_profile, resolve_defaults

# -- hardware profile and defaults -------------------------------------------------------------
from engine.hardware.profile import HardwareProfile, detect
from engine.hardware.threads import ThreadChoice, apply_cpu_threads
from engine.hardware.vram import DeviceMemory, GpuHealth, device_memory, gpu_health

# -- estimates (from a model's config.json alone) ----------------------------------------------
from engine.models.estimate import ModelInfo, estimate_vram, fit_verdict, model_info

# -- models and data preview -------------------------------------------------------------------
from engine.models.loading import ModelLoadError, check_model_folder, load_tokenizer, resolve_model_source

# -- bundled resources -------------------------------------------------------------------------
from engine.resources import DEMO_DATA_FILE, DEMO_HELDOUT_FILE, DEMO_MODEL_DIR, DEMO_PRESET, PRESETS_DIR, RESOURCES

# -- run folders, and their history for the Runs page (issue 14 item 4) -----------------------
from engine.runs import (
    RUNNING_WINDOW_S,
    RunFolder,
    RunFolderError,
    RunHistory,
    RunInfo,
    RunSummary,
    best_label,
    config_differences,
    failure_log,
    list_runs,
    new_run_folder,
    read_run,
    run_folder_of,
    shown_status,
    summarize_runs,
    write_problem,
)

# -- several processes (torchrun) ---------------------------------------------------------------
from engine.train.distributed import CONTROL_FILE, DistContext, launch_command, visible_gpus
from engine.train.guard import sleep_lock_problem  # can a run keep the machine awake (Hardware page)

if TYPE_CHECKING:
    from engine.train.session import ProbeUnavailable, TrainingSession

# Names resolved on first use, because their modules import torch at the top.
_LAZY = {"TrainingSession": "engine.train.session", "ProbeUnavailable": "engine.train.session"}

# What warm_up() imports: everything a training run, an export and a chat load.
_HEAVY = (
    "torch",
    "transformers",
    "peft",
    "datasets",
    "safetensors.torch",
    "engine.train.session",
    "engine.train.step",
    "engine.train.checkpoint",
    "engine.data.dataset",
    "engine.models.loading",
    "engine.models.lora",
    "engine.models.patches",
    "engine.export.merged",
)


def describe_fast_paths(model_type: str) -> dict[str, str]:
    """{fast path: "on" | why it is off} for an architecture, from its model_type alone (what a
    run gets on a CUDA GPU with every switch on "auto"). Imports torch."""
    from engine.models.patches import describe_fast_paths as describe

    return describe(model_type)


def warm_up() -> float:
    """Import what a training run, an export and a chat need (torch, transformers, peft, datasets
    and the engine's modules over them); returns the seconds it took. Meant for a pool thread
    while the person is still choosing, so no run pays for the imports. A piece that does not
    import is skipped: it shows up, readable, when it is used."""
    t0 = time.perf_counter()
    from engine.models.loading import quiet_third_party

    # bitsandbytes says "Failed to load CPU gemm_4bit_forward from kernels-community" when imported
    # (through peft) on a machine without the optional kernels package: nothing a user can act on.
    with quiet_third_party():
        for name in _HEAVY:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    try:
        import transformers

        # transformers imports its model classes on first use; touch them now.
        transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018
    except ImportError:
        pass
    return time.perf_counter() - t0


def cli_main(argv: list[str] | None = None, more_commands=(), description: str = "") -> int:
    """The headless command line (`tunesmith train | export | hw | demo`); `more_commands` and
    `description`: the console command's own commands and words for the help (engine.cli.build_parser)."""
    from engine.cli import main

    return main(argv, more_commands, description)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.api' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "VERSION",
    # config
    "AUTO",
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "LoraConfig",
    "DataConfig",
    "TrainingConfig",
    "FastPathConfig",
    "OutputConfig",
    # session
    "TrainingSession",
    # events
    "Event",
    "RunStarted",
    "StepMetrics",
    "LogLine",
    "CheckpointSaved",
    "Paused",
    "Resumed",
    "Finished",
    "Failed",
    "event_from_dict",
    # events: recovery and the pre-flight (issue 15)
    "MemoryAdjusted",
    "RolledBack",
    "DiskFull",
    "PreflightResult",
    # evaluation while training, the gallery, the probe (issue 14)
    "EvalMetrics",
    "GalleryAnswers",
    "ProbeUnavailable",
    # training methods: GRPO's sampled completions with their rewards (issue 30)
    "CompletionSamples",
    "best_label",
    # run folders
    "RunFolder",
    "RunFolderError",
    "RunInfo",
    "shown_status",
    "RUNNING_WINDOW_S",
    "list_runs",
    "read_run",
    "run_folder_of",
    "failure_log",  # where a failure's traceback goes when its run made no folder
    # a new run's folder: the name it gets, and why none can be written there (issue 28 item 7)
    "new_run_folder",
    "write_problem",
    # run history (the Runs page)
    "RunHistory",
    "RunSummary",
    "summarize_runs",
    "config_differences",
    # hardware
    "HardwareProfile",
    "detect",
    "apply_cpu_threads",
    "sleep_lock_problem",
    "ThreadChoice",
    "prefer_expandable_segments",
    "apply_defaults",
    "resolve_defaults",
    "explain_defaults",
    "format_profile",
    "DoctorCheck",
    "doctor_checks",
    "doctor_report",
    "doctor_install_fix",
    "DeviceMemory",
    "device_memory",
    "gpu_health",
    "GpuHealth",
    # estimates
    "ModelInfo",
    "model_info",
    "estimate_vram",
    "fit_verdict",
    # fast paths
    "describe_fast_paths",
    "requested_but_not_run",
    # models and data preview
    "ModelLoadError",
    "resolve_model_source",
    "check_model_folder",
    "load_tokenizer",
    "DataError",
    "DATA_FILE_SUFFIXES",
    "DATA_FILE_WORDS",
    "DataPreview",
    "RenderedExample",
    "PackingLayout",
    "load_preview",
    "shown_row",
    "render_example",
    "packing_layout",
    "XRay",
    "xray",
    "xray_scan",
    "packing_scan",
    "PACKING_SAMPLE",
    "Cancelled",
    "DATA_FINDINGS",
    "METHOD_DATA",
    # export
    "EXPORTERS",
    "ExportKind",
    "ExportOption",
    "ExportError",
    "run_exports",
    "destinations",
    "export_adapter",
    "export_merged",
    "find_adapter",
    "run_config_for",
    # export self-check, GGUF and Ollama (issue 16)
    "ExportResult",
    "SelfCheckFailed",
    "export_and_check",
    "read_export_report",
    "GGUF_QUANTS",
    "gguf_missing",
    "install_gguf_extra",
    "push_to_hub",
    # chat
    "load_chat_model",
    "generate_reply",
    "RunChat",
    "ChatError",
    "load_tools",
    "template_uses_tools",
    "tool_name",
    # resources
    "RESOURCES",
    "DEMO_MODEL_DIR",
    "DEMO_DATA_FILE",
    "DEMO_HELDOUT_FILE",
    "DEMO_PRESET",
    "PRESETS_DIR",
    # several processes
    "DistContext",
    "CONTROL_FILE",
    "launch_command",
    "visible_gpus",
    # startup and the command line
    "warm_up",
    "cli_main",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
