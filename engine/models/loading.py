"""Load a base model and tokenizer: the bundled demo, a local Hugging Face folder, or a Hub id.

Safety first: code shipped with a model runs only when `model.trust_remote_code` is on, and
pickle weight files (.bin / .pt, which can execute code when unpickled) are refused unless
`model.allow_pickle` is on. Every failure is a `ModelLoadError` that says what to do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import warnings
from pathlib import Path

from engine.config import ModelConfig
from engine.resources import DEMO_MODEL_DIR

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelLoadError(RuntimeError):
    """The model or its tokenizer cannot be loaded; the message says why and what to do."""


def resolve_model_source(name_or_path: str) -> tuple[str, bool]:
    """(path or Hub id, is_local). "demo" is the bundled model."""
    if name_or_path == "demo":
        return str(DEMO_MODEL_DIR), True
    p = Path(name_or_path).expanduser()
    if p.exists():
        return str(p), True
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelLoadError(f"model folder {name_or_path} does not exist")
    return name_or_path, False


def check_local_folder(path: str, allow_pickle: bool) -> None:
    """Raise a ModelLoadError with the first thing that stops `path` from being trained on (see
    check_model_folder)."""
    problems = check_model_folder(path, allow_pickle)
    if problems:
        raise ModelLoadError(problems[0])


def _not_a_folder(path: Path) -> str:
    """Why a file is not a model: in the words of what it is."""
    if path.suffix.lower() == ".gguf":
        return (
            f"{path} is a GGUF file, llama.cpp's format for running a model: training needs the model's "
            "Hugging Face folder (config.json, *.safetensors and the tokenizer), such as the repository "
            "the GGUF was converted from"
        )
    if path.suffix.lower() in (".safetensors", *PICKLE_SUFFIXES):
        return f"{path} is one weights file: pick the folder that holds it with its config.json and tokenizer"
    return f"{path} is not a folder: pick a Hugging Face model folder"


def config_json_problem(folder: Path) -> str | None:
    """Why the folder's config.json cannot be read, naming the file and the JSON error's line and
    column; None when it reads as a JSON object. (A broken config.json is its own problem: it was
    refused as 'holds no weights' when the weights were there.)"""
    import json

    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return f"{path} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"
    except UnicodeDecodeError as exc:
        return f"{path} is not UTF-8 text (byte {exc.start}): it is not a Hugging Face config"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if not isinstance(data, dict):
        return f"{path} holds a JSON {type(data).__name__}, not the object of settings a model config is"
    return None


def check_model_folder(path: str, allow_pickle: bool = False) -> list[str]:
    """What stops a local folder from being trained on, one sentence each ([] when it can be):
    no config.json or one that is not valid JSON, no weights (*.safetensors, or pickle .bin/.pt
    only with `allow_pickle`), no tokenizer files. Reads file names and the small config.json
    only: cheap enough for the window to call on every change."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [_not_a_folder(folder)]
    problems = []
    if not (folder / "config.json").is_file():
        problems.append(f"{folder} has no config.json: it is not a Hugging Face model folder")
    else:
        problems += [p for p in [config_json_problem(folder)] if p]
    safe = list(folder.glob("*.safetensors"))
    pickles = [f for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES and "training_args" not in f.name]
    if not safe and not pickles:
        problems.append(f"{folder} holds no weights (no *.safetensors file)")
    elif not safe and not allow_pickle:
        problems.append(
            f"{folder} holds only pickle weights ({pickles[0].name}), which can run code when loaded; "
            "convert them to safetensors or set model.allow_pickle: true if you trust them"
        )
    if not any((folder / name).is_file() for name in (*TOKENIZER_FILES, "vocab.txt")):
        problems.append(f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or tokenizer_config.json)")
    return problems


# Third-party modules whose deprecation notices are about their own internals (e.g. PEFT reading
# transformers' `is_gradient_checkpointing`), not about anything a user can change.
_NOISY_MODULES = r"(transformers|peft|bitsandbytes|accelerate|huggingface_hub)(\.|$)"


@contextlib.contextmanager
def quiet_third_party():
    """Within the block, silence the noise third-party libraries print while a model loads or
    gets its adapter: transformers' info/warning logs and tqdm bars ("Loading weights"),
    bitsandbytes' import-time notices ("Failed to load CPU gemm_4bit_forward from
    kernels-community"), Hugging Face `kernels`' offline notices, and FutureWarnings/
    DeprecationWarnings raised from inside transformers, PEFT or bitsandbytes. Scoped: everything
    is put back on exit, errors still raise, and the engine's own messages (its events, its
    loggers, warnings from engine modules) pass."""
    restore = []
    if "transformers" in sys.modules or importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

        def _restore_hf():
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()

        restore.append(_restore_hf)
    # bitsandbytes' notices, and those of Hugging Face's `kernels` (which transformers >= 5.25 pulls
    # in): "Skipping publisher trust check for 'kernels-community/...' because Hugging Face Hub is in
    # offline mode" at every load on a machine without the network.
    for name in ("bitsandbytes", "kernels"):
        quiet = logging.getLogger(name)
        restore.append(functools.partial(quiet.setLevel, quiet.level))
        quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
            ignore_peft_conversion_notice()
            yield
    finally:
        for undo in reversed(restore):
            undo()


def ignore_peft_conversion_notice() -> None:
    """Inside a warnings.catch_warnings() block: drop PEFT's "The following rank_pattern keys did not
    match any targeted module and were ignored: ['.*\\.gate_up_proj']". PEFT adds those patterns
    itself, for transformers 5's fused MoE experts (Ernie-4.5-MoE, AFMoE, Hunyuan-MoE, ...), which
    LoRA leaves frozen here; the engine never sets a pattern, so the notice has nothing to tell a user."""
    warnings.filterwarnings(
        "ignore",
        message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
        category=RuntimeWarning,
    )


def _import_peft_quietly() -> None:
    """Import PEFT (which imports bitsandbytes when installed, and bitsandbytes logs its optional
    kernels' absence at import) inside `quiet_third_party`, so the first import is the quiet one."""
    if "peft" not in sys.modules and importlib.util.find_spec("peft") is not None:
        import peft  # noqa: F401


def _hub_error(source: str, exc: Exception) -> ModelLoadError:
    text = str(exc)
    offline = any(s in text for s in ("offline", "Connection", "connect", "resolve", "Network", "timed out"))
    if offline:
        return ModelLoadError(
            f"cannot reach the Hugging Face Hub to download '{source}' and it is not in the local "
            "cache; connect to the internet or choose a local model folder"
        )
    return ModelLoadError(f"cannot load '{source}' from the Hugging Face Hub: {text.splitlines()[0] if text else exc}")


def _from_pretrained(loader, cfg: ModelConfig, what: str, **kwargs):
    """Resolve and check the source, call `loader.from_pretrained`, and turn failures into
    ModelLoadErrors that say whether the folder or the Hub is at fault."""
    source, local = resolve_model_source(cfg.name_or_path)
    if local:
        check_local_folder(source, cfg.allow_pickle)
    try:
        return loader.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except OSError as exc:
        if local:
            raise ModelLoadError(f"cannot read the {what} in {source}: {exc}") from exc
        raise _hub_error(source, exc) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not cfg.trust_remote_code:
            # transformers names its own argument; the user sets the config's field.
            raise ModelLoadError(
                f"'{source}' needs the code shipped with the model (its config's auto_map) to load its {what}: "
                "set model.trust_remote_code: true if you trust that code"
            ) from exc
        raise ModelLoadError(f"cannot load the {what} of '{source}': {exc}") from exc


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, cfg, "tokenizer")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # The engine cuts every example at data.max_seq_len itself (and the X-ray names rows it cuts), so
    # transformers' "Token indices sequence length is longer than …" about a full row is noise:
    # mark it as said, the tokenizer's own switch for it.
    tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_model(cfg: ModelConfig, device, dtype_name: str):
    """Load the causal LM onto `device` in `dtype_name`; 4-bit NF4 when cfg.load_in_4bit is True.
    Third-party noise during the load is silenced (`quiet_third_party`)."""
    with quiet_third_party():
        return _load_model(cfg, device, dtype_name)


def _load_model(cfg: ModelConfig, device, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    _import_peft_quietly()
    device = torch.device(device)
    kwargs = dict(
        dtype=torch_dtype(dtype_name),
        use_safetensors=None if cfg.allow_pickle else True,
        low_cpu_mem_usage=True,
    )
    if cfg.load_in_4bit is True:
        if device.type != "cuda":
            raise ModelLoadError("4-bit (QLoRA) loading needs a CUDA GPU; set model.load_in_4bit: false")
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as exc:
            raise ModelLoadError(f"4-bit loading needs bitsandbytes, which does not import: {exc}") from exc
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype(dtype_name),
        )
        kwargs["device_map"] = {"": device.index or 0}
    model = _from_pretrained(AutoModelForCausalLM, cfg, "model", **kwargs)
    if cfg.load_in_4bit is not True:
        model.to(device)
    return model
