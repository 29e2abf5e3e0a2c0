"""torch's varlen flash attention as a transformers attention implementation, for the HF peers.

`register()` adds `ATTN_NAME` to transformers' `AttentionInterface`: an attention function
that runs `torch.nn.attention.varlen.varlen_attn` (FlashAttention over packed documents, no
mask, no padding) on the packed row. Document boundaries come from the flash-attention kwargs
transformers already routes to every attention call (`cu_seq_lens_q`, `max_length_q`, what
TRL's padding-free collator and transformers' DataCollatorWithFlattening put in a batch);
`varlen_kwargs` builds them once per step on the host for the HF peers. Without them the
function derives the boundaries from the packed `position_ids` (restarts at 0), which costs a
device-to-host sync per layer, as transformers' own flash path does in that case.
`attn_options(device)` is what a peer calls before building its model (register, or
NotSupported with the reason).

A name that transformers' mask interface does not know gets no mask built (masking_utils
exits early for it), so no block-diagonal mask is ever materialized.

`varlen_attn` runs FlashAttention kernels: CUDA only (on the CPU the op has no kernel), bf16
or fp16. `unavailable(device)` says why it cannot run, or None.
"""

from __future__ import annotations

import functools
import inspect

ATTN_NAME = "bench_varlen"


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:  # torch older than 2.10 has no varlen module
        return None, f"torch.nn.attention.varlen.varlen_attn does not import ({type(exc).__name__}: {exc})"
    return varlen_attn, None


def unavailable(device) -> str | None:
    """Why the varlen peer cannot run on `device`, or None when it can."""
    import torch

    fn, why = _varlen_fn()
    if fn is None:
        return why
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return "torch.nn.attention.varlen.varlen_attn runs FlashAttention kernels: CUDA only (no CPU kernel)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"varlen_attn's FlashAttention needs sm80 or newer (this GPU is sm{major}x)"
    return None


def signature_note() -> dict:
    """What this torch's varlen_attn takes (the record says which call was made)."""
    fn, why = _varlen_fn()
    if fn is None:
        return {"varlen_attn": why}
    params = inspect.signature(fn).parameters
    return {
        "varlen_attn": "torch.nn.attention.varlen.varlen_attn",
        "causal": "window_size=(-1, 0)" if "window_size" in params else "is_causal=True",
        "gqa": "enable_gqa=True" if "enable_gqa" in params else "K/V heads repeated",
    }


def cu_seqlens_from_positions(position_ids):
    """(cu_seqlens int32 [N+1], longest document) of a packed row whose positions restart at 0."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    total = torch.tensor([pos.numel()], device=pos.device, dtype=starts.dtype)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int(cu.diff().max())  # int(): the kernel takes the longest length as a host int


def varlen_kwargs(lengths) -> dict:
    """The flash-attention kwargs of a packed row of documents of these lengths (host tensors)."""
    import torch

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    longest = int(max(lengths))
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.lru_cache(maxsize=8)
def _params(fn) -> frozenset:
    # Read once per kernel, not per layer call: W1 is bound by host time.
    return frozenset(inspect.signature(fn).parameters)


def varlen_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers' attention-function contract: q/k/v [B, H, S, D] -> ([B, S, H, D], None)."""
    import torch

    fn, why = _varlen_fn()
    if fn is None:
        raise RuntimeError(why)
    if sliding_window is not None:
        raise NotImplementedError(f"{ATTN_NAME}: sliding-window layers are not wired (no workload has them)")
    if query.shape[0] != 1:
        raise NotImplementedError(f"{ATTN_NAME}: one packed row per step, got batch {query.shape[0]}")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None:
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError(f"{ATTN_NAME} needs cu_seq_lens_q or packed position_ids")
        cu_q, max_q = cu_seqlens_from_positions(pos)
        cu_k, max_k = cu_q, max_q
    cu_q = cu_q.to(query.device, torch.int32)
    cu_k = cu_q if cu_k is None else cu_k.to(query.device, torch.int32)
    max_q, max_k = int(max_q), int(max_k if max_k is not None else max_q)

    h, hk, d = query.shape[1], key.shape[1], query.shape[-1]
    # [1, H, S, D] -> [S, H, D]: the packed layout the kernel takes.
    q = query.transpose(1, 2).reshape(-1, h, d)
    k = key.transpose(1, 2).reshape(-1, hk, d)
    v = value.transpose(1, 2).reshape(-1, hk, d)
    params = _params(fn)
    extra = {}
    if hk != h:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # an older varlen_attn without GQA: repeat K/V heads, as transformers' eager path does
            k = k.repeat_interleave(h // hk, dim=1)
            v = v.repeat_interleave(h // hk, dim=1)
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0)
        extra["window_size"] = (-1, 0)
    else:  # torch 2.10
        extra["is_causal"] = True
    if scaling is not None and "scale" in params:
        extra["scale"] = scaling
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
    return out.unsqueeze(0), None  # [1, S, H, D]


def attn_options(device) -> dict:
    """For a peer about to build its model on `device`: register the attention function and
    return the record's note on it (`attn_implementation` is the name to build the model with);
    raises NotSupported when varlen_attn cannot run there."""
    from bench.runner import NotSupported

    why = unavailable(device)
    if why:
        raise NotSupported(why)
    return {"attn_implementation": register(), **signature_note()}


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)
    return ATTN_NAME
