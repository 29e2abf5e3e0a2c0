"""Packed (varlen) attention for training: dispatch, and the transformers attention function.

`varlen_attention` runs attention over packed documents: the Triton kernel on CUDA
(engine.kernels.varlen_attention), torch's own flash varlen kernel (torch.nn.attention.varlen,
"torch_flash") or flash-attn's when asked for and present, and a per-document SDPA reference
elsewhere (the CPU path).

`enable_packed_attention(model)` registers "tunesmith_varlen" in transformers' AttentionInterface
and switches a (PEFT-wrapped or plain) model to it. Each layer then reads the packing metadata the
collator built once per batch (`cu_seq_lens_q`, `max_length_q` in the model kwargs, see
engine.fastpath.packed.PackedSeqInfo.model_kwargs) and never asks the device for lengths.

No mask function is registered on purpose: transformers' mask builders return None at once for an
implementation missing from AttentionMaskInterface (4.5x through 5.24), whereas a registered one
makes `create_causal_mask` scan position_ids for packed rows, a device-to-host sync per forward.
So no dense [T x T] mask is ever built and the step stays sync-free. The price: a 2-D padding mask
never reaches this function, so batched padded generation must switch back first
(`disable_packed_attention`); decoding with a KV cache and explicit 4-D masks fall back to a
dense path here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from engine.counters import count, count_fallback
from engine.fastpath import packed
from engine.kernels.varlen_attention import KEPT_KWARG, varlen_attention_reference
from engine.kernels.varlen_attention_configs import MAX_HEAD_DIM
from engine.peft_model import hf_model

ATTN_NAME = "tunesmith_varlen"
# What enable_packed_attention decided, kept here rather than as attributes of transformers'
# objects: the options of each module of a switched model, and the implementation it had before.
# Weak keys: a dropped model takes its entries with it.
_OPTIONS: "weakref.WeakKeyDictionary[torch.nn.Module, PackedAttentionOptions]" = weakref.WeakKeyDictionary()
_PREVIOUS: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PackedAttentionOptions:
    # False: every layer rebuilds cu_seqlens from position_ids with a host sync, as peers do
    # (the benchmark ablation, engine.config.FastPathConfig.cached_metadata).
    cached_metadata: bool = True
    # Use flash-attn's varlen kernel instead of ours when it is importable.
    use_flash_attn: bool = False
    # varlen_attention backend: "auto" (Triton on CUDA, reference on CPU); tests force "triton"
    # to run the kernel through the interpreter inside a model.
    backend: str = "auto"


DEFAULT_OPTIONS = PackedAttentionOptions()


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    *,
    scale=None,
    causal=True,
    sliding_window=None,
    softcap=None,
    backend: str = "auto",
    info: Optional[packed.PackedSeqInfo] = None,
    dropout_p: float = 0.0,
    kept=None,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention over packed documents: q/k [T, Hq or Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]
    (Dv < D for MLA).

    `cu_seqlens` int32 [n_docs + 1] on q's device; `max_seqlen` a Python int (flash-attn sizes
    its grid with it; our kernel uses block tables instead). `sliding_window` W: query i sees
    keys i - W < j <= i (transformers' meaning). `softcap`: s = cap * tanh(s / cap).
    backend: "auto" (Triton on CUDA, reference elsewhere), "triton", "torch_flash", "flash_attn",
    "reference".
    `info`: the PackedSeqInfo owning `cu_seqlens`, if known (found automatically otherwise);
    it supplies host-built block tables. `dropout_p` > 0 forces the reference (training only).
    `kept`: the layer's KeptAttention from the offloader (engine.kernels.varlen_attention), used
    by the Triton kernel only. `sinks`: [Hq] attention-sink logits (GPT-OSS) or None; flash-attn
    and torch's kernels take none, so a call with sinks runs ours (or the reference off CUDA).
    """
    d, dv = q.shape[-1], v.shape[-1]
    if (sinks is not None or dv != d) and backend in ("flash_attn", "torch_flash"):
        backend = "auto"  # neither takes sinks, nor values narrower than the keys
    if backend == "auto":
        # Head dims wider than the kernel tiles (> MAX_HEAD_DIM, 512) take the reference.
        backend = "triton" if q.is_cuda and kernel_head_dim(d, dv) is not None else "reference"
    if dropout_p > 0.0:
        backend = "reference"
    if backend == "reference":
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # Its loop over the documents is Python, fixed at capture: a replay with other lengths
            # would attend across the wrong bounds. So a step graph cannot hold it, and says why.
            if dropout_p > 0.0:
                why = "attention dropout"
            elif kernel_head_dim(d, dv) is None:
                why = f"head dim {max(d, dv)} over {MAX_HEAD_DIM}"
            else:
                why = "asked for"
            raise RuntimeError(f"reference attention ({why}) loops over documents on the host: not capturable")
        count("attention:reference")  # its cu_seqlens.tolist() counts a host sync
        return varlen_attention_reference(
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen,
            scale=scale,
            causal=causal,
            sliding_window=sliding_window,
            softcap=softcap,
            dropout_p=dropout_p,
            sinks=sinks,
        )
    if backend == "flash_attn":
        count("attention:flash_attn")
        return _flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, sliding_window, softcap)
    if backend == "torch_flash":
        if softcap is not None:
            raise ValueError("the torch_flash attention backend has no softcap")
        count("attention:torch_flash")
        return _torch_flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, sliding_window)
    if backend != "triton":
        raise ValueError(f"unknown attention backend {backend!r}")
    from engine.kernels.varlen_attention import varlen_attention_triton

    width = kernel_head_dim(d, dv)
    if width is None:
        raise ValueError(f"the triton attention backend tiles head dims up to {MAX_HEAD_DIM}, got {d} (values {dv})")
    if width != d or width != dv:
        # MLA (DeepSeek-V2/V3, GLM-4-MoE-Lite: queries and keys 192 wide, values 128) and other head
        # dims that are not a power of two: zeros appended to q and k leave q.k as it was, and to v
        # add output columns that are cut off; the scale stays the unpadded one.
        count("attention:padded_head_dim")
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        pad = torch.nn.functional.pad
        q, k, v = pad(q, (0, width - d)), pad(k, (0, width - d)), pad(v, (0, width - dv))
    if info is None:
        info = packed.lookup(cu_seqlens)
    tables = info.block_table if info is not None and info.cu_seqlens.device == q.device else None
    covers = info is not None and info.total_tokens == q.shape[0]
    count("attention:varlen_triton")
    # The longest document as a host int picks the backward (one-pass for long documents, see
    # engine.kernels.varlen_attention_bwd; TUNESMITH_ATTN_BWD=split|onepass|auto overrides).
    return varlen_attention_triton(
        q,
        k,
        v,
        cu_seqlens,
        info.max_seqlen if info is not None else max_seqlen,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        tables=tables,
        covers_all_tokens=covers,
        kept=kept,
        sinks=sinks,
    )[..., :dv]


def kernel_head_dim(d: int, dv: int) -> Optional[int]:
    """The head dim the Triton kernel runs for queries/keys of `d` and values of `dv`: the next
    power of two of both, at least 16; None past MAX_HEAD_DIM (the widest it tiles)."""
    width = max(16, 1 << (max(d, dv) - 1).bit_length())
    return width if width <= MAX_HEAD_DIM else None


def _flash_attn_varlen(q, k, v, cu, max_seqlen, scale, causal, sliding_window, softcap):
    from flash_attn import flash_attn_varlen_func

    if max_seqlen is None:  # flash-attn sizes its grid from it; reading it is a sync
        max_seqlen = (cu[1:] - cu[:-1]).max()
    if isinstance(max_seqlen, torch.Tensor):
        count("host_syncs")
        max_seqlen = int(max_seqlen)
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        softcap=float(softcap or 0.0),
    )


@functools.lru_cache(maxsize=1)
def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def backend_available(backend: str, q: torch.Tensor) -> bool:
    """Whether `backend` can run attention on tensors like `q` [T, H, D] in this process."""
    d = q.shape[-1]
    if backend in ("reference", "auto"):
        return True
    if backend == "triton":
        return q.is_cuda and kernel_head_dim(d, d) is not None
    if backend == "flash_attn":
        return q.is_cuda and flash_attn_available()
    if backend == "torch_flash":
        # torch's in-tree flash kernels: CUDA, 16-bit, head_dim a multiple of 8 up to 256.
        fn, _ = _torch_varlen_fn()
        return fn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
    return False


def _torch_flash_varlen(q, k, v, cu, max_seqlen, scale, causal, sliding_window):
    fn, params = _torch_varlen_fn()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    if max_seqlen is None or isinstance(max_seqlen, torch.Tensor):  # the grid needs a host int
        max_seqlen = int((cu[1:] - cu[:-1]).max() if max_seqlen is None else max_seqlen)
        count("host_syncs")
    kwargs = {"scale": scale}
    if "window_size" in params:  # torch >= 2.11; 2.10 had only is_causal
        left = sliding_window - 1 if sliding_window is not None else -1
        kwargs["window_size"] = (left, 0 if causal else -1)
    else:
        if sliding_window is not None:
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no sliding window")
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True  # older versions take fewer kv heads as they are
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


# ------------------------------------------------------------------------------------------
# transformers integration
# ------------------------------------------------------------------------------------------


def _dense_attention(
    module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, is_causal, sinks=None
):
    """Eager-style attention for what packed rows do not cover: a KV cache (query shorter than
    keys) or an explicit 4-D mask. query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D]; `sinks` [Hq]
    or None."""
    b, hq, tq, d = query.shape
    tk = key.shape[2]
    group = hq // key.shape[1]
    key = key.repeat_interleave(group, 1)
    value = value.repeat_interleave(group, 1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        m = attention_mask[:, :, :, :tk]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    else:
        qpos = torch.arange(tk - tq, tk, device=query.device)[:, None]
        kpos = torch.arange(tk, device=query.device)[None, :]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
        if is_causal:
            keep &= kpos <= qpos
        if sliding_window is not None:
            keep &= (qpos - kpos) < sliding_window
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per head in every row, with no value (GPT-OSS)
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout > 0.0 and module.training:
        probs = torch.nn.functional.dropout(probs, dropout)
    out = (probs @ value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


_SINGLE_DOC_INFOS: dict = {}


def _single_documents(rows: int, length: int, device: torch.device) -> packed.PackedSeqInfo:
    # Each row one document; the lengths come from shapes, so no sync. Cached so a run of
    # unpacked batches of one shape builds this once, not once per layer.
    key = (rows, length, str(device))
    info = _SINGLE_DOC_INFOS.get(key)
    if info is None:
        if len(_SINGLE_DOC_INFOS) > 32:
            _SINGLE_DOC_INFOS.clear()
        info = packed.PackedSeqInfo.from_lengths([length] * rows).to(device)
        _SINGLE_DOC_INFOS[key] = info
    return info


def tunesmith_varlen_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, T, D] ->
    ([B, T, Hq, D], None). Packed rows (B == 1) come with `cu_seq_lens_q`/`max_length_q`
    from the collator; without them, from the batch's own `position_ids` (packed.lookup_positions,
    no sync), else the documents are found from the positions' values (a sync, counted) or, with
    neither, every row is one document."""
    opts = _OPTIONS.get(module, DEFAULT_OPTIONS)
    b, hq, t, d = query.shape
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    is_causal = kwargs.get("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks, [Hq]
    if attention_mask is not None or key.shape[2] != t:
        count("attention:dense")
        count_fallback("packed_attention", "KV cache" if key.shape[2] != t else "explicit attention mask")
        return _dense_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, is_causal, sinks
        )

    cu = kwargs.get("cu_seq_lens_q")
    info = None
    if cu is not None and opts.cached_metadata:
        max_len = kwargs.get("max_length_q")
        info = packed.lookup(cu)
    else:
        pos = kwargs.get("position_ids")
        if pos is not None and b == 1 and opts.cached_metadata:
            # A layer that dropped the packing kwargs but passed the batch's own positions.
            info = packed.lookup_positions(pos)
        if info is None and pos is not None:
            info = packed.PackedSeqInfo.from_position_ids(pos.expand(b, -1))
        elif info is None:
            info = _single_documents(b, t, query.device)
        cu, max_len = info.cu_seqlens, info.max_seqlen
    if cu.device != query.device or cu.dtype != torch.int32:
        cu = cu.to(device=query.device, dtype=torch.int32)
        info = None

    if b == 1:  # views, whatever the layout the projections left
        # squeeze, not x[0]: select's backward zero-fills a whole gradient and copies the incoming
        # one into it (strided, after the transpose), and the view back to [T, H*D] then copies
        # again; squeeze's backward is a view, so the attention's dQ/dK/dV flow back uncopied.
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
    else:
        q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1]) for x in (query, key, value))
    backend = opts.backend
    if opts.use_flash_attn and query.is_cuda and flash_attn_available():
        backend = "flash_attn"
    drop = dropout if module.training else 0.0
    out = varlen_attention(
        q,
        k,
        v,
        cu,
        max_len,
        scale=scaling,
        causal=is_causal,
        sliding_window=sliding_window,
        softcap=softcap,
        backend=backend,
        info=info,
        dropout_p=drop,
        kept=kwargs.get(KEPT_KWARG),
        sinks=sinks,
    )
    return out.view(b, t, hq, value.shape[-1]), None


def register() -> None:
    """Register "tunesmith_varlen" with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, tunesmith_varlen_attention_forward)


def enable_packed_attention(
    model, *, cached_metadata: bool = True, use_flash_attn: bool = False, backend: str = "auto"
) -> str:
    """Switch `model` (plain or PEFT-wrapped transformers model) to packed varlen attention.

    Returns "on", or "off: <reason>" leaving the model as it was."""
    try:
        from transformers import PreTrainedModel
    except Exception as exc:  # pragma: no cover - transformers is a dependency
        return f"off: transformers unavailable ({exc})"
    base = hf_model(model)
    if not isinstance(base, PreTrainedModel):
        return f"off: {type(base).__name__} is not a transformers PreTrainedModel"
    for name, mod in base.named_modules():
        # DeepSeek Sparse Attention (DeepSeek-V3.2/V4, HunYuan-V4, GLM-5, ...): an indexer picks each
        # query's keys and hands them over as a mask; this function has no such selection.
        if getattr(mod, "indexer", None) is not None:
            return f"off: {name} picks its keys with a sparse-attention indexer, which {ATTN_NAME} does not run"
    can_set = getattr(base, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return f"off: {type(base).__name__} does not dispatch attention through AttentionInterface"
    if float(getattr(base.config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return "off: attention dropout > 0 (the varlen kernel has no dropout)"

    register()
    previous = base.config._attn_implementation
    try:
        base.set_attn_implementation(ATTN_NAME)
    except Exception as exc:
        # Older releases lack set_attn_implementation or validate names strictly: set the field
        # every attention module reads at call time.
        try:
            _set_config_impl(base, ATTN_NAME)
        except Exception:
            return f"off: could not switch attention implementation ({exc})"
    if base.config._attn_implementation != ATTN_NAME:
        return f"off: model kept attn_implementation={base.config._attn_implementation!r}"
    options = PackedAttentionOptions(cached_metadata=cached_metadata, use_flash_attn=use_flash_attn, backend=backend)
    for mod in base.modules():
        _OPTIONS[mod] = options
    _PREVIOUS.setdefault(base, previous)
    if use_flash_attn and not flash_attn_available():
        warnings.warn("flash-attn is not importable; using the Triton varlen kernel", stacklevel=2)
    return "on"


def _set_config_impl(base, name) -> None:
    from transformers import PretrainedConfig

    seen = set()
    for mod in base.modules():
        cfg = getattr(mod, "config", None)
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            if getattr(cfg, "_attn_implementation", None) != name:
                cfg._attn_implementation = name


@contextlib.contextmanager
def unpacked_attention(model):
    """The attention implementation from before enable_packed_attention for the duration, then
    packed again with the same options: what batched padded generation (transformers' generate
    over left-padded prompts) needs, as no 2-D padding mask reaches the packed function. A model
    without packed attention is left as it is."""
    base = hf_model(model)
    previous = _PREVIOUS.get(base)
    if previous is None or base.config._attn_implementation != ATTN_NAME:
        yield
        return
    _switch_impl(base, previous)
    try:
        yield
    finally:
        _switch_impl(base, ATTN_NAME)


def _switch_impl(base, name) -> None:
    try:
        base.set_attn_implementation(name)
    except Exception:
        _set_config_impl(base, name)


def disable_packed_attention(model) -> str:
    """Restore the attention implementation the model had before enable_packed_attention."""
    base = hf_model(model)
    previous = _PREVIOUS.pop(base, None)
    if previous is None:
        return "off: packed attention was not enabled"
    try:
        base.set_attn_implementation(previous)
    except Exception:
        _set_config_impl(base, previous)
    for mod in base.modules():
        _OPTIONS.pop(mod, None)
    return "restored " + str(previous)
