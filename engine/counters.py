"""Per-step counters: what the engine's bookkeeping cost and which fast paths actually ran.

Counted where things happen (engine.fastpath.packed, engine.fastpath.attention, engine.fastpath.moe, engine.kernels.*,
engine.fastpath.lora, engine.models.patches); the training loop reads and resets them once per
optimizer step, so each StepMetrics event can show "metadata built once, 0 syncs" and which
fast paths ran, not only which were patched. Plain ints in one dict: counting must cost
nothing on the hot path (a dict increment, never a device sync).

Keys (all counts are per optimizer step, gradient-checkpointing recomputes included):

- ``metadata_builds``: packed-sequence metadata built (once per micro-batch is ideal).
- ``host_syncs``: host reads of tensor values (``.tolist()``, ``int(t)``) the engine makes; on a
  GPU each is a device-to-host sync. Counted on every device, so CPU tests see them too.
- ``moe_calls``: MoE blocks through the grouped path; ``moe:grouped_mm`` / ``moe:loop`` which
  matmul path those calls took.
- ``lora_linears`` / ``lora_mlp``: forward calls of the fused LoRA Functions (LoRALinears for
  q/k/v and o, LoRAMLP for the gated MLP).
- ``<op>:triton`` / ``<op>:torch`` for op in rmsnorm, rope, activations, fused_ce, token_logp: forward
  computations of each kernel op by the path that ran (the Triton kernel or its torch
  reference; on a CPU the reference is the engine's path); ``fused_ce:streamed``: the loss
  streamed over a tied table in host memory (engine.fastpath.host_head).
- ``attention:<backend>``: packed attention calls by backend (varlen_triton, torch_flash,
  flash_attn, reference) and ``attention:dense``, the dense path of the packed attention
  function for a KV cache or an explicit mask.
- ``nf4_dequant:<path>`` / ``nf4_matmul:<path>``: a 4-bit (NF4) base weight decoded whole
  (Triton kernel or torch reference), or multiplied with the weight decoded inside the matmul
  (``nf4_matmul:triton``) or by dequantize + torch matmul (``nf4_matmul:torch``); on CUDA a
  product that could not use the kernel is also a ``fallback:nf4_matmul: <reason>``.
- ``fallback:<module kind>: <reason>``: a patched module took the stock path at run time
  (autocast on, a KV cache, adapters disabled, ...). Created on first use; reset removes them.
"""

from __future__ import annotations

from typing import Mapping, Optional

# Always present in a reset_counters() snapshot (older callers compare these exactly).
BASE_KEYS = ("metadata_builds", "host_syncs", "moe_calls")

CALL_KEYS = (
    "lora_linears",
    "lora_mlp",
    "rmsnorm:triton",
    "rmsnorm:torch",
    "rope:triton",
    "rope:torch",
    "activations:triton",
    "activations:torch",
    "fused_ce:triton",
    "fused_ce:torch",
    "fused_ce:streamed",
    "token_logp:triton",
    "token_logp:torch",
    "attention:varlen_triton",
    "attention:torch_flash",
    "attention:flash_attn",
    "attention:reference",
    "attention:dense",
    "moe:grouped_mm",
    "moe:loop",
    "nf4_dequant:triton",
    "nf4_dequant:torch",
    "nf4_matmul:triton",
    "nf4_matmul:torch",
)

FALLBACK = "fallback:"

COUNTERS: dict[str, int] = {k: 0 for k in BASE_KEYS + CALL_KEYS}


def count_fallback(kind: str, reason: str) -> None:
    """A patched module of `kind` ran its stock forward for `reason` (a short phrase)."""
    key = f"{FALLBACK}{kind}: {reason}"
    COUNTERS[key] = COUNTERS.get(key, 0) + 1


def reset_counters() -> dict[str, int]:
    """Return the counts since the last reset and zero them.

    The snapshot holds the BASE_KEYS always and every other key only when it is non-zero.
    """
    snapshot = {k: v for k, v in COUNTERS.items() if v or k in BASE_KEYS}
    for k in [k for k in COUNTERS if k.startswith(FALLBACK)]:
        del COUNTERS[k]
    for k in COUNTERS:
        COUNTERS[k] = 0
    return snapshot


def split_counts(snapshot: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(fast_path_calls, fallbacks) of a reset_counters() snapshot, non-zero entries only.

    fast_path_calls: the call keys and moe_calls; fallbacks: {"<module kind>: <reason>": n}.
    """
    calls: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for k, v in snapshot.items():
        if not v:
            continue
        if k.startswith(FALLBACK):
            fallbacks[k[len(FALLBACK) :]] = v
        elif k not in ("metadata_builds", "host_syncs"):
            calls[k] = v
    return calls, fallbacks


# -- which requested fast paths ran -------------------------------------------------------------

# Fast path (a key of prepare_model's report) -> the call keys that show it ran, and the Triton
# (or other device) keys among them: on a GPU, a path that ran only its torch reference did not
# run as planned.
_RAN_BY: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("rmsnorm:triton", "rmsnorm:torch"),
    "rope": ("rope:triton", "rope:torch"),
    "activations": ("activations:triton", "activations:torch"),
    "lora_qkv": ("lora_linears",),
    "lora_o": ("lora_linears",),
    "lora_mlp": ("lora_mlp",),
    "packed_attention": (
        "attention:varlen_triton",
        "attention:torch_flash",
        "attention:flash_attn",
        "attention:reference",
    ),
    "fused_ce": ("fused_ce:triton", "fused_ce:torch", "fused_ce:streamed"),
    "moe_grouping": ("moe_calls",),
}
_REFERENCE_ONLY = {"rmsnorm:torch", "rope:torch", "activations:torch", "fused_ce:torch", "attention:reference"}

# Module kind of a fallback -> the fast paths that module's stock forward skipped.
FALLBACK_KINDS: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("rmsnorm",),
    "attention": ("lora_qkv", "lora_o", "rope"),
    "lora_qkv": ("lora_qkv",),
    "lora_o": ("lora_o",),
    "mlp": ("lora_mlp", "activations"),
    "lora_mlp": ("lora_mlp",),
    "packed_attention": ("packed_attention",),
    "moe": ("moe_grouping",),
}


def requested(status: str) -> bool:
    """Whether a fast-path report value asks for the path to run ("on...", "partial k/n: ...")."""
    return status.startswith(("on", "partial"))


def requested_but_not_run(
    report: Mapping[str, str], calls: Mapping[str, int], fallbacks: Optional[Mapping[str, int]] = None, device: str = ""
) -> dict[str, str]:
    """{fast path: what went wrong} for the paths `report` requested that a step did not run.

    `report`: prepare_model's {name: "on..." | "partial k/n: why" | "off: why"}; `calls` and
    `fallbacks`: one step's StepMetrics.fast_path_calls / .fallbacks. A requested path
    "did not run" when none of its calls were counted; it "ran on some layers only" when it ran
    but a module of its kind also fell back to the stock path; on a CUDA `device`, a kernel
    path that ran only its torch reference says so. Paths this module cannot observe (offload,
    cached_metadata) are never listed. Empty when everything requested ran everywhere.
    """
    fallbacks = fallbacks or {}
    why: dict[str, list[str]] = {}
    for entry, n in fallbacks.items():
        if not n:
            continue
        kind, _, reason = entry.partition(": ")
        for path in FALLBACK_KINDS.get(kind, ()):
            why.setdefault(path, []).append(f"{reason} ({n}x)")
    out: dict[str, str] = {}
    for path, status in report.items():
        keys = _RAN_BY.get(path)
        if keys is None or not requested(str(status)):
            continue
        ran = {k: calls.get(k, 0) for k in keys if calls.get(k, 0)}
        reasons = "; ".join(why.get(path, []))
        if not ran:
            out[path] = "did not run" + (f": {reasons}" if reasons else "")
        elif reasons:
            out[path] = f"ran on some layers only; the others fell back: {reasons}"
        elif device.startswith("cuda") and set(ran) <= _REFERENCE_ONLY:
            out[path] = "ran its torch reference, not the GPU kernel"
    return out


__all__ = [
    "COUNTERS",
    "BASE_KEYS",
    "CALL_KEYS",
    "count_fallback",
    "reset_counters",
    "split_counts",
    "requested",
    "requested_but_not_run",
    "FALLBACK_KINDS",
]
