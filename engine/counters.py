"""Per-step counters: what the engine's bookkeeping cost and which fast paths actually ran.

Counted where things happen (engine.fastpath.packed, engine.fastpath.attention, engine.fastpath.moe, engine.kernels.*,
engine.fastpath.lora, engine.models.patches) with `count(key)`; the training loop reads and resets
them once per optimizer step, so each StepMetrics event can show "metadata built once, 0 syncs"
and which fast paths ran, not only which were patched. Plain ints in a dict: counting must cost
nothing on the hot path (a context lookup and a dict increment, never a device sync).

Who owns the counts: a `Counters` object per run. The session creates one and activates it
(`with counters.active():`) on the thread that runs it, so two sessions in one process (two
threads, or one after the other) never see each other's counts. The active object lives in a
`contextvars.ContextVar`, and a ContextVar has a value only in the thread (or asyncio task) that
set it, so a count made on a thread with no value needs a rule:

1. this thread's active Counters;
2. inside a backward pass, the Counters of the thread that started it. On CUDA the autograd
   engine runs backward nodes (and so the recompute of checkpointed layers, and the base weight
   decoded for dx) on its own device thread, where no ContextVar is set; torch stashes the
   launching thread's context for those threads (`torch._C._stash_obj_in_tls("context", ...)`
   in torch.autograd.graph._engine_run_backward) and we read our variable from it. On a CPU
   backward runs on the launching thread and rule 1 applies;
3. the one run active in the process, when exactly one is (a torch without rule 2's stash, or
   a thread the engine did not start, such as a paused run's probe on the window's thread: its
   counts go where they always went, and the probe drops them as the gallery does, through
   engine.train.evaluation.side_effect_free, before the next step counts);
4. otherwise `UNOWNED`, counted but never reported (a library call with no run, a probe while
   two runs train). Module-level `reset_counters()` and tests outside a run use it the same way.

A CUDA graph replays kernels, not Python: counts are made once, at capture, whatever the rule.

Keys (all counts are per optimizer step, gradient-checkpointing recomputes included):

- ``metadata_builds``: packed-sequence metadata built (once per micro-batch is ideal).
- ``host_syncs``: host reads of tensor values (``.tolist()``, ``int(t)``) the engine makes; on a
  GPU each is a device-to-host sync. Counted on every device, so CPU tests see them too.
- ``moe_calls``: MoE blocks through the grouped path; ``moe:grouped_mm`` / ``moe:loop`` which
  matmul path those calls took.
- ``lora_linears`` / ``lora_mlp``: forward calls of the fused LoRA Functions (LoRALinears for
  q/k/v and o, LoRAMLP for the gated MLP); ``lora_cache_builds``: their groups' adapter weights
  cast, stacked and scaled anew (engine.fastpath.lora_group.LoRAGroup.weights: once per group and
  weight update is ideal; a bookkeeping count like metadata_builds, not a fast path).
- ``stacked_gemm``: base GEMMs over stacked frozen weights (gate and up as one operand,
  engine.fastpath.lora_group.stack_bases): the fused MLP's forward where its input is narrow
  enough for one GEMM to pay, and the input gradient over the side-by-side d_gate/d_up.
- ``folded_gemm``: forwards of a q/k/v or gate/up group with LoRA's rank product inside the base
  GEMMs (engine.fastpath.lora_fold: [x | xA^T] against [W | sB]); ``folded_gemm:copied``: those
  whose input was copied into a wide buffer (its producer, a patched norm, left no spare columns);
  ``folded_gemm:dx``: input gradients of such a group made through the same folded weight (dy [W | sB]
  gives dx's base part and dy sB in one GEMM); ``folded_gemm:rows``: input gradients of an o or down
  projection through its weight folded by rows ([dy | dy sB] against [W; A], one GEMM).
- ``rank_grad:triton`` / ``wide_rows:triton``: LoRA's rank-wide gradients and the row-folded input
  gradient's wide operand made by their Triton kernels (engine.kernels.rank_grad, .wide_rows).
- ``<op>:triton`` / ``<op>:torch`` for op in rmsnorm, rope, activations, fused_ce, token_logp: forward
  computations of each kernel op by the path that ran (the Triton kernel or its torch
  reference; on a CPU the reference is the engine's path); ``add_rmsnorm:<path>``: those of the
  rmsnorm computations fused with the residual add before them (counted under both keys);
  ``qk_norm_rope:triton``: per-head q/k norms fused with the rotation after them
  (engine.kernels.qk_norm_rope; each call also counts its two rmsnorm and one rope computations);
  ``fused_ce:streamed``: the loss
  streamed over a tied table in host memory (engine.fastpath.host_head).
- ``attention:<backend>``: packed attention calls by backend (varlen_triton, torch_flash,
  flash_attn, reference) and ``attention:dense``, the dense path of the packed attention
  function for a KV cache or an explicit mask; ``attention:padded_head_dim``: Triton calls whose
  head dims were padded to one the kernel tiles (MLA's 192-wide keys over 128-wide values);
  ``attention:shrunk_tiles``: a fixed launch config shrunk to fit the card's shared memory (an
  RTX card's 99 KiB at head dims 256 and 512), once per config and process.
- ``nf4_dequant:<path>`` / ``nf4_matmul:<path>``: a 4-bit (NF4) base weight decoded whole
  (Triton kernel or torch reference), or multiplied with the weight decoded inside the matmul
  (``nf4_matmul:triton``) or by dequantize + torch matmul (``nf4_matmul:torch``); on CUDA a
  product that could not use the kernel is also a ``fallback:nf4_matmul: <reason>``.
- ``fallback:<module kind>: <reason>``: a patched module took the stock path at run time
  (autocast on, a KV cache, adapters disabled, ...). Created on first use; reset removes them.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Mapping, Optional

# Always present in a reset snapshot (older callers compare these exactly).
BASE_KEYS = ("metadata_builds", "host_syncs", "moe_calls")
CALL_KEYS = (
    "lora_linears",
    "lora_mlp",
    "lora_cache_builds",
    "stacked_gemm",
    "folded_gemm",
    "folded_gemm:copied",
    "folded_gemm:dx",
    "folded_gemm:rows",
    "rmsnorm:triton",
    "rmsnorm:torch",
    "add_rmsnorm:triton",
    "add_rmsnorm:torch",
    "qk_norm_rope:triton",
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
    "attention:padded_head_dim",
    "attention:shrunk_tiles",
    "moe:grouped_mm",
    "moe:loop",
    "nf4_dequant:triton",
    "nf4_dequant:torch",
    "nf4_matmul:triton",
    "nf4_matmul:torch",
    "rank_grad:triton",
    "wide_rows:triton",
)

FALLBACK = "fallback:"


class Counters(dict):
    """One run's counts: {key: n}, every BASE_KEYS and CALL_KEYS key present (zero until counted)."""

    def __init__(self) -> None:
        super().__init__((k, 0) for k in BASE_KEYS + CALL_KEYS)

    def reset(self) -> dict[str, int]:
        """Return the counts since the last reset and zero them.

        The snapshot holds the BASE_KEYS always and every other key only when it is non-zero.
        """
        snapshot = {k: v for k, v in self.items() if v or k in BASE_KEYS}
        for k in [k for k in self if k.startswith(FALLBACK)]:
            del self[k]
        for k in self:
            self[k] = 0
        return snapshot

    @contextmanager
    def active(self) -> Iterator["Counters"]:
        """Count into this object on this thread (and in backward passes it starts) until the block ends."""
        global _ACTIVE
        token = _CURRENT.set(self)
        with _LOCK:
            _ACTIVE = _ACTIVE + (self,)
        try:
            yield self
        finally:
            with _LOCK:
                i = next(i for i, c in enumerate(_ACTIVE) if c is self)
                _ACTIVE = _ACTIVE[:i] + _ACTIVE[i + 1 :]
            _CURRENT.reset(token)

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Counts made inside the block are dropped: the counts come back as they were before it."""
        before = dict(self)
        try:
            yield
        finally:
            self.reset()
            self.update(before)


UNOWNED = Counters()  # rule 4 of the module docstring: counts no run reports
_CURRENT: ContextVar[Counters] = ContextVar("tunesmith_counters")
# Runs active in the process, for rule 3: a tuple replaced whole under _LOCK, so a reader on
# another thread sees one consistent value without taking the lock.
_ACTIVE: tuple[Counters, ...] = ()
_LOCK = threading.Lock()
# Rule 2's reader of torch's stash: (is_key_in_tls, get_obj_in_tls), or () for a torch without
# it; None until torch is imported (this module never imports torch: engine.api stays light).
_STASH: Optional[tuple] = None


def _elsewhere() -> Counters:
    """Rules 2-4: the Counters for a thread on which no run is active."""
    global _STASH
    stash = _STASH
    if stash is None:
        torch_c = sys.modules.get("torch._C")
        if torch_c is not None:
            is_key, get_obj = getattr(torch_c, "_is_key_in_tls", None), getattr(torch_c, "_get_obj_in_tls", None)
            _STASH = stash = (is_key, get_obj) if is_key is not None and get_obj is not None else ()
    if stash and stash[0]("context"):
        counters = stash[1]("context").get(_CURRENT)
        if counters is not None:
            return counters
    active = _ACTIVE
    return active[0] if len(active) == 1 else UNOWNED


def current() -> Counters:
    """The Counters a count made here goes to (the rules of the module docstring)."""
    counters = _CURRENT.get(None)
    return counters if counters is not None else _elsewhere()


def count(key: str) -> None:
    """One more `key` (a BASE_KEYS or CALL_KEYS name) in the current Counters."""
    counters = _CURRENT.get(None)
    if counters is None:
        counters = _elsewhere()
    counters[key] += 1


def count_fallback(kind: str, reason: str) -> None:
    """A patched module of `kind` ran its stock forward for `reason` (a short phrase)."""
    counters = current()
    key = f"{FALLBACK}{kind}: {reason}"
    counters[key] = counters.get(key, 0) + 1


def reset_counters() -> dict[str, int]:
    """The current Counters' snapshot, zeroed (`Counters.reset`)."""
    return current().reset()


def split_counts(snapshot: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(fast_path_calls, fallbacks) of a reset snapshot, non-zero entries only.

    fast_path_calls: the call keys and moe_calls; fallbacks: {"<module kind>: <reason>": n}.
    """
    calls: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for k, v in snapshot.items():
        if not v:
            continue
        if k.startswith(FALLBACK):
            fallbacks[k[len(FALLBACK) :]] = v
        elif k not in ("metadata_builds", "host_syncs", "lora_cache_builds"):
            calls[k] = v
    return calls, fallbacks


# -- which requested fast paths ran -------------------------------------------------------------

# Fast path (a key of prepare_model's report) -> the call keys that show it ran, and the Triton
# (or other device) keys among them: on a GPU, a path that ran only its torch reference did not
# run as planned.
_RAN_BY: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("rmsnorm:triton", "rmsnorm:torch"),
    "add_rmsnorm": ("add_rmsnorm:triton", "add_rmsnorm:torch"),
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
_REFERENCE_ONLY = {
    "rmsnorm:torch",
    "add_rmsnorm:torch",
    "rope:torch",
    "activations:torch",
    "fused_ce:torch",
    "attention:reference",
}

# Module kind of a fallback -> the fast paths that module's stock forward skipped.
FALLBACK_KINDS: dict[str, tuple[str, ...]] = {
    "rmsnorm": ("rmsnorm",),
    "add_rmsnorm": ("add_rmsnorm",),
    "attention": ("lora_qkv", "lora_o", "rope"),
    "lora_qkv": ("lora_qkv",),
    "lora_o": ("lora_o",),
    "mlp": ("lora_mlp", "activations"),
    "lora_mlp": ("lora_mlp",),
    "packed_attention": ("packed_attention",),
    "moe": ("moe_grouping",),
    # GRPO sampled through transformers' `generate` (engine.train.objectives.grpo): the objective's
    # report names the path the same (Objective.fast_paths).
    "decode_loop": ("decode_loop",),
    # A micro-batch that could not replay a CUDA graph (engine.train.step_graph) ran eagerly.
    "cuda_graphs": ("cuda_graphs",),
}
# Fast paths seen only through their fallbacks: the decode loop samples inside
# StepContext.generating(), whose counts are set aside, so only its refusal is counted.
# A replayed graph counts its layers' calls, not itself: CUDA graphs are seen by their fallbacks too.
_SEEN_BY_FALLBACK = frozenset({"decode_loop", "cuda_graphs"})


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
    path that ran only its torch reference says so. A path seen only through its fallbacks
    (GRPO's decode_loop) "fell back" when one was counted. Paths this module cannot observe
    (offload, cached_metadata) are never listed. Empty when everything requested ran everywhere.
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
        if not requested(str(status)):
            continue
        reasons = "; ".join(why.get(path, []))
        if path in _SEEN_BY_FALLBACK:
            if reasons:
                out[path] = f"fell back: {reasons}"
            continue
        if keys is None:
            continue
        ran = {k: calls.get(k, 0) for k in keys if calls.get(k, 0)}
        if not ran:
            out[path] = "did not run" + (f": {reasons}" if reasons else "")
        elif reasons:
            out[path] = f"ran on some layers only; the others fell back: {reasons}"
        elif device.startswith("cuda") and set(ran) <= _REFERENCE_ONLY:
            out[path] = "ran its torch reference, not the GPU kernel"
    return out


__all__ = [
    "Counters",
    "UNOWNED",
    "BASE_KEYS",
    "CALL_KEYS",
    "current",
    "count",
    "count_fallback",
    "reset_counters",
    "split_counts",
    "requested",
    "requested_but_not_run",
    "FALLBACK_KINDS",
]
