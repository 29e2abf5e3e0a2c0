"""What the Model page shows about a model before any weights load: shapes and parameter
count from its config.json, memory estimates for 16-bit LoRA and 4-bit QLoRA against the
detected GPU, and the fast paths the engine reports for its architecture.

Runs on a pool thread (a Hub id may mean a download of config.json). Only engine APIs are
used for the numbers; this module just gathers them into one plain dict for the page.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

POPULAR_MODELS = [
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B Instruct — tiny, fast to try"),
    ("Qwen/Qwen3-0.6B", "Qwen3 0.6B"),
    ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "SmolLM2 1.7B Instruct"),
    ("meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B Instruct (gated: accept the licence on the Hub)"),
    ("google/gemma-3-1b-it", "Gemma 3 1B IT (gated)"),
    ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen2.5 1.5B Instruct"),
    ("meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B Instruct (gated)"),
    ("Qwen/Qwen3-4B", "Qwen3 4B"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral 7B Instruct v0.3"),
    ("meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B Instruct (gated)"),
]

OFFLINE_HINT = "Local model folders and the bundled demo still work."
# One short try decides "offline" (huggingface_hub's own retries take about 90 s to give up).
PROBE_SECONDS = 3.0


def _hub_endpoint() -> tuple[str, int]:
    """(host, port) of the Hub this process talks to (HF_ENDPOINT, else huggingface.co)."""
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        url = constants.ENDPOINT
    except Exception:
        url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(url)
    return parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme != "http" else 80)


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """One TCP connection to the Hub's host, within `timeout` seconds."""
    host, port = _hub_endpoint()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _cached_config(source: str) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "config.json")
    except Exception:
        return None
    return path if isinstance(path, str) else None


class ModelReportError(RuntimeError):
    pass


def read_model_config(name_or_path: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it came from). Never loads weights or remote code."""
    from engine.api import ModelLoadError, resolve_model_source

    try:
        source, local = resolve_model_source(name_or_path)
    except ModelLoadError as exc:
        raise ModelReportError(str(exc)) from None
    if local:
        cfg = Path(source) / "config.json"
        if not cfg.is_file():
            raise ModelReportError(f"{source} has no config.json: it is not a Hugging Face model folder")
        try:
            return json.loads(cfg.read_text(encoding="utf-8")), str(cfg)
        except (OSError, ValueError) as exc:
            raise ModelReportError(f"cannot read {cfg}: {exc}") from None
    # A cached config needs no network; without one, a short probe tells "offline" in seconds.
    path = _cached_config(source)
    if path is None and not hub_reachable():
        host, _ = _hub_endpoint()
        raise ModelReportError(
            f"Offline: cannot reach the Hugging Face Hub ({host}) to read '{source}', and it is not in "
            f"the local cache. {OFFLINE_HINT}"
        )
    try:
        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(source, "config.json", etag_timeout=PROBE_SECONDS)
    except Exception as exc:  # offline, unknown repo, gated repo: all mean "cannot see it"
        text = str(exc)
        name = type(exc).__name__
        if "Offline" in name or "LocalEntryNotFound" in name or "offline" in text.lower() or "connect" in text.lower():
            raise ModelReportError(
                f"Offline: cannot reach the Hugging Face Hub to read '{source}', and it is not in the "
                f"local cache. {OFFLINE_HINT}"
            ) from None
        if "GatedRepo" in name or "401" in text or "403" in text:
            raise ModelReportError(
                f"'{source}' is gated: accept its licence on the Hub and log in (huggingface-cli login)."
            ) from None
        if "RepositoryNotFound" in name or "404" in text:
            raise ModelReportError(f"There is no model '{source}' on the Hugging Face Hub.") from None
        raise ModelReportError(
            f"Cannot read '{source}' from the Hub: {text.splitlines()[0] if text else name}"
        ) from None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")), path
    except (OSError, ValueError) as exc:
        raise ModelReportError(f"cannot read {path}: {exc}") from None


def device_memory(profile) -> tuple[int, str]:
    """(bytes a run can plan around, what that memory is) from the engine's HardwareProfile."""
    if profile is None:
        return 0, "unknown device"
    d = profile_dict(profile)
    if d.get("kind") != "cpu" and d.get("total_vram"):
        return int(d["total_vram"]), str(d.get("gpu_name") or "GPU")
    # No CUDA GPU: the run happens in host memory, so that is what it must fit in.
    return int(d.get("ram_available") or 0), "CPU RAM (no CUDA GPU)"


def profile_dict(profile) -> dict[str, Any]:
    if profile is None:
        return {}
    if hasattr(profile, "to_dict"):
        return profile.to_dict()
    import dataclasses

    if dataclasses.is_dataclass(profile):
        return dataclasses.asdict(profile)
    return dict(vars(profile))


FAST_PATH_LABELS = {
    "rmsnorm": "RMSNorm kernel",
    "add_rmsnorm": "residual add fused with RMSNorm",
    "rope": "RoPE kernel",
    "activations": "gated-MLP activation kernel",
    "lora_qkv": "fused LoRA QKV",
    "lora_o": "fused LoRA O",
    "lora_mlp": "fused LoRA MLP",
    "packed_attention": "packed varlen attention",
    "fused_ce": "fused cross-entropy",
    "moe_grouping": "grouped MoE experts",
    "packed_rows": "documents packed into shared rows",
}


# Which config switch turns each listed fast path on or off (engine.config.FastPathConfig).
SWITCH_OF = {
    "RMSNorm kernel": "kernels",
    "residual add fused with RMSNorm": "add_rmsnorm",
    "RoPE kernel": "kernels",
    "gated-MLP activation kernel": "kernels",
    "fused LoRA QKV": "lora_autograd",
    "fused LoRA O": "lora_autograd",
    "fused LoRA MLP": "lora_autograd",
    "fused cross-entropy": "fused_ce",
    "packed varlen attention": "packed_attention",
    "grouped MoE experts": "moe_grouping",
}
# What needs CUDA: on a machine without it the hardware policy turns these off (the plain-torch
# references run), so the Model page must not call them on.
NEEDS_CUDA = {"kernels", "add_rmsnorm", "lora_autograd", "fused_ce"}


def for_this_machine(fast_paths: dict[str, str], profile, switches: dict[str, Any]) -> dict[str, str]:
    """The architecture's listing as this machine and this config will run it: a switch the
    config turns off, or a path that needs CUDA on a machine without it, reads off with why."""
    on_cpu = profile_dict(profile).get("kind") == "cpu" if profile is not None else False
    out = {}
    for label, status in fast_paths.items():
        switch = SWITCH_OF.get(label)
        if switch and switches.get(switch) is False and str(status).startswith("on"):
            status = f"off: fast_paths.{switch} is false"
        elif switch in NEEDS_CUDA and on_cpu and str(status).startswith("on"):
            status = "off on this machine: no CUDA GPU (the plain-torch reference runs)"
        out[label] = status
    return out


def fast_paths_for(model_type: str) -> Optional[dict[str, str]]:
    """{fast path: "on" | why not} for an architecture, as the engine reports it; None when
    the engine cannot say. Imports torch: call it on a pool thread."""
    from engine.api import describe_fast_paths

    try:
        report = describe_fast_paths(model_type)
    except Exception:
        return None
    return {FAST_PATH_LABELS.get(k, k): v for k, v in report.items()}


def model_report(name_or_path: str, seq_len: int, lora_r: int, profile) -> dict[str, Any]:
    from engine.api import estimate_vram, fit_verdict, model_info

    config, origin = read_model_config(name_or_path)
    try:
        info = model_info(config)
    except Exception as exc:
        raise ModelReportError(f"cannot read the model's shapes from {origin}: {exc}") from None
    total, device = device_memory(profile)
    rows = []
    for mode, label in (("lora16", "16-bit LoRA"), ("qlora4", "4-bit QLoRA")):
        need = estimate_vram(info, seq_len, lora_r=lora_r, mode=mode)
        verdict = fit_verdict(need, total) if total else "—"
        if mode == "qlora4" and device.startswith("CPU"):
            verdict = "needs CUDA"  # bitsandbytes' 4-bit layers run on CUDA GPUs only
        rows.append({"mode": mode, "label": label, "bytes": need, "verdict": verdict})
    return {
        "name": name_or_path,
        "origin": origin,
        "info": info,
        "vram": rows,
        "device_total": total,
        "device": device,
        "fast_paths": fast_paths_for(info.model_type),
        "lora_params": info.lora_params(lora_r),
        "seq_len": seq_len,
    }
