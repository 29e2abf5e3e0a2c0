"""Offloaded gradient checkpointing: each decoder layer's input waits in host memory.

With plain gradient checkpointing every layer keeps its input on the device until backward
(W3: 36 layers x 128 MiB). Here each layer runs as one `OffloadedLayer` autograd Function:

- forward: run the layer without autograd, then copy its input to a pinned host buffer on a
  side (copy) stream, so the device copy is freed as soon as the copy has read it;
- backward: bring the input back, recompute the layer with autograd, backpropagate through
  it (LoRA gradients accumulate into `.grad` as in reentrant checkpointing) and return the
  input gradient.

Two ways to bring inputs back:

- "double": when layer i's backward starts, the reload of layer i-1's input is issued on the
  copy stream, so it travels while layer i recomputes and backpropagates; two layer inputs
  are on the device at once (one extra layer input of memory). The last layer's input, the
  first one backward needs, is not parked at all: it stays on the device through the head
  and the loss (as if its reload had been prefetched at the end of the forward), so no
  reload in the step makes the compute stream wait (`reloads_waited` 0).
- "single": layer i's input is reloaded when its backward starts and the compute waits for
  it (`reloads_waited` = layers); one layer input on the device, and the copy time shows.

Whether a step can afford "double" is decided from the previous step's measured peak
(torch's peak allocated memory, read when its backward reached the first layer) plus the
second buffer, against what the process can allocate (under any per-process cap). The first
step, with nothing measured yet, uses the free memory at its start. "double" also falls back
to "single" for the rest of a step if allocating the second buffer runs out of memory.

Long documents: when attention is a large part of a layer's work (`attention_keep_bytes`
says when, from the batch's lengths) and there is room, each layer's attention output and
softmax statistics stay on the device from the first forward to the recompute, which then
skips the attention forward kernel. Each layer's slot owns a KeptAttention
(engine.kernels.varlen_attention) that the offloader hands to the layer's attention call
through the layer's kwargs; nothing is switched globally.

Nothing here asks the device anything per layer: copies and waits are stream events, so
there are no device-to-host syncs.

A parked input's device memory is let go one layer later, in stream order: when layer i+1 parks,
the compute stream waits for layer i's copy to the host (issued a layer earlier, so long done on
the device) and the offloader drops its reference, so the allocator can hand the block out again
at once. `record_stream` would instead keep each block until the allocator sees the copy's event
complete, and the host runs the forward layers ahead of the device: on the H200 W3's peak held 8
parked inputs (1 GiB) waiting so (bench --memory-peak). Only the last parked input, which the head
and the loss follow, is left to `record_stream`.

Single-buffered long rows (at least EARLY_RELEASE_TOKENS tokens: a memory-short step, as W7's
under a 16 GiB cap) let the parked input go at the start of the next layer instead: the compute
stream waits for its copy there (about 30 ms for a 196k-token row on the H200, against seconds of
the layer's own work), so one layer input less is live at the forward's peak, inside that layer.

On a CPU there is no copy stream; the "host buffer" is a plain CPU tensor (a copy that saves
nothing), which keeps the mechanism testable without a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from engine.fastpath import recompute
from engine.fastpath.streams import side_stream
from engine.kernels.varlen_attention import KEPT_KWARG, KeptAttention

MODES = ("single", "double")
# Rows from this many tokens, single-buffered, let a parked input go at the next layer's start
# (module docstring): there one layer's compute dwarfs the copy it waits for (a 65k-token row's
# input takes about 10 ms to copy at hidden 4,096; the layer's forward about 100 ms on the H200).
EARLY_RELEASE_TOKENS = 65_536
# Headroom kept free beside the second buffer when choosing double buffering.
DOUBLE_BUFFER_MARGIN = 256 * 2**20
# Keep attention outputs for the recompute when the attention forward costs at least this
# share of a layer's projection matmuls (W6, one 32k document: about 0.86; packed rows of
# ~256-token documents: under 0.01, where keeping would cost memory for nothing).
ATTENTION_KEEP_MIN_SHARE = 0.25


@dataclass
class OffloadStats:
    """What one step did; read and reset by the training loop."""

    mode: str = ""  # mode used in the last step ("double" or "single")
    layers: int = 0  # layer inputs parked in the step (double: the last one kept on the device)
    bytes_offloaded: int = 0
    fell_back: str = ""  # why double buffering was not used, when it was asked for
    reloads_waited: int = 0  # reloads issued only when the compute stream needed them (it waited)
    attention_kept: str = ""  # "kept", or why attention outputs were not kept ("" = not asked)
    attention_layers: int = 0  # layers whose attention output was kept (the Triton kernel keeps)
    copies: bool = False  # inputs travel to the host and back (CUDA); on a CPU nothing is reloaded

    def note(self) -> str:
        """One line for the step's metrics: "double", "single (why)", "..., attention kept"."""
        note = self.mode + (f" ({self.fell_back})" if self.fell_back else "")
        if self.copies and self.layers:
            note += f", {self.reloads_waited} of {self.layers} reloads waited"
        if self.attention_layers:
            note += f", attention kept in {self.attention_layers} layers"
        elif self.attention_kept.startswith("not kept"):
            note += f", attention {self.attention_kept}"
        return note


@dataclass
class _Slot:
    """One layer's parked input: the host buffer and, once reloaded, the device copy."""

    host: Optional[torch.Tensor] = None  # flat pinned buffer, grown when needed
    shape: tuple = ()
    dtype: torch.dtype = torch.float32
    numel: int = 0
    device_copy: Optional[torch.Tensor] = None  # filled by a prefetch
    ready: Optional[torch.cuda.Event] = None  # recorded on the copy stream after the reload
    saved: bool = False
    # The layer's attention outputs kept from its forward for its recompute.
    attention: KeptAttention = field(default_factory=KeptAttention)


class ActivationOffloader:
    """Parks decoder-layer inputs in host memory; installs itself as the layers' checkpoint function."""

    def __init__(
        self,
        mode: str,
        device,
        keep_attention_allowed: bool = True,
        lean_recompute: bool = True,
        keep_rng: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"offload mode must be one of {MODES}, not {mode!r}")
        self.mode = mode  # what was asked for
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copy_stream = side_stream(self.device, "offload") if self.cuda else None
        self.slots: list[_Slot] = []
        self.stats = OffloadStats()
        self._step_mode = mode
        self._step_second = 0  # bytes of this step's second buffer (one layer input)
        # This step's parked inputs are let go at the next layer's start (single, long rows).
        self._early_release = False
        # (peak allocated bytes, mode, second-buffer bytes) of the last step whose backward
        # reached the first layer; None until one has (CUDA only).
        self._measured: Optional[tuple[int, str, int]] = None
        self._keep_attention = False
        self.keep_attention_allowed = bool(keep_attention_allowed)  # FastPathConfig.keep_attention
        # FastPathConfig.lean_recompute: the recompute tells the layer its output is unread
        # (engine.fastpath.recompute), so a patched layer skips what only the output needs.
        self.lean_recompute = bool(lean_recompute)
        # Keep each layer's RNG state for its recompute only where the model draws random numbers
        # (engine.train.step.draws_random): reading it costs a device-state read per layer, and a
        # CUDA graph cannot read it while capturing.
        self.keep_rng = bool(keep_rng)
        # Advanced whenever a slot's pinned host buffer is (re)allocated: a CUDA graph captured
        # before reads and writes the old buffers' addresses (engine.train.step_graph recaptures).
        self.host_generation = 0
        # The last parked input still on the device and its copy's event (see the module docstring).
        self._pending: Optional[tuple[torch.Tensor, torch.cuda.Event]] = None
        # An input that always requires grad, so every layer's backward runs even when the
        # first layer's input (frozen embeddings) needs no gradient.
        self._grad_anchor = torch.empty(0, device=self.device, requires_grad=True)

    # -- wiring ---------------------------------------------------------------------------------

    def install(self, layers) -> int:
        """Make each checkpointed decoder layer (transformers' GradientCheckpointingLayer) offload."""
        self.slots = [_Slot() for _ in layers]
        for i, layer in enumerate(layers):
            layer._gradient_checkpointing_func = partial(self.checkpoint, i)
        return len(layers)

    def begin_step(self, tokens: int, hidden_size: int, dtype: torch.dtype, attention_keep_bytes: int = 0) -> str:
        """Choose this step's mode (double needs room for one more layer input); returns it.

        `attention_keep_bytes` > 0: keeping every layer's attention output for the recompute
        pays off for this batch and needs that much device memory (see attention_keep_bytes);
        it is done when that fits beside the second buffer."""
        self.stats = OffloadStats(copies=self.cuda)
        self._release_pending()  # a step that failed midway may have left one behind
        self._step_mode = self.mode
        self._keep_attention = False
        for slot in self.slots:  # a step that failed midway (OOM) may have left reloads behind
            slot.device_copy, slot.ready, slot.saved = None, None, False
            slot.attention.outputs.clear()
        # One query of the device's free memory per step, only when something depends on it.
        free = free_device_bytes(self.device) if self.cuda and (self.mode == "double" or attention_keep_bytes) else 0
        self._step_second = tokens * hidden_size * torch.finfo(dtype).bits // 8
        if self.mode == "double" and self.cuda:
            why = self._second_buffer_short(free)
            if why:
                self._step_mode = "single"
                self.stats.fell_back = why
            else:
                free -= self._step_second + DOUBLE_BUFFER_MARGIN
        if attention_keep_bytes > 0:
            # At most half of what is free: the rest stays for the step's own working memory.
            need = 2 * attention_keep_bytes + DOUBLE_BUFFER_MARGIN
            if self.cuda and free < need:
                self.stats.attention_kept = f"not kept: free VRAM {free / 2**20:.0f} MiB < {need / 2**20:.0f} MiB"
            else:
                self._keep_attention = True
                self.stats.attention_kept = "kept"
        self.stats.mode = self._step_mode
        self._early_release = self._step_mode == "single" and tokens >= EARLY_RELEASE_TOKENS
        return self._step_mode

    def _second_buffer_short(self, free: int) -> str:
        allocated = torch.cuda.memory_allocated(self.device) if self._measured is not None else 0
        return second_buffer_short(self._step_second, free, allocated, self._measured)

    def _measure_step(self) -> None:
        """The step's backward reached the first layer: its peak is in (its optimizer step
        adds little). The peak since the last reset bounds the step's from above, so a stale,
        higher peak can only make the next choice more careful."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            self._measured = (peak, self._step_mode, self._step_second)

    def stop_keeping_attention(self) -> None:
        """No more kept attention outputs in this run (after a step ran out of memory with
        them); drops any a failed step left behind."""
        self.keep_attention_allowed = False
        self._keep_attention = False
        for slot in self.slots:
            slot.attention.outputs.clear()

    # -- the checkpoint function the layers call ------------------------------------------------

    def checkpoint(self, index: int, fn: Callable, hidden: torch.Tensor, *args):
        """Called by the layer as `_gradient_checkpointing_func(forward_partial, hidden, ...)`."""
        if not torch.is_grad_enabled():  # no backward will come (e.g. generation in train mode)
            return fn(hidden, *args)
        if args:  # positional extras would have to be parked too; transformers passes kwargs
            raise TypeError("offloaded checkpointing expects the hidden states as the only positional input")
        return OffloadedLayer.apply(self, index, fn, self._grad_anchor, hidden)

    # -- host side ------------------------------------------------------------------------------

    def _park(self, index: int, hidden: torch.Tensor) -> None:
        slot = self.slots[index]
        n = hidden.numel()
        if self.cuda and self._step_mode == "double" and index == len(self.slots) - 1:
            # The last layer's input is the first one backward needs: keep it (its "reload",
            # prefetched). It costs the second buffer's memory while the head and loss run,
            # when no other reload is on the device.
            slot.shape, slot.dtype, slot.numel = tuple(hidden.shape), hidden.dtype, n
            slot.device_copy, slot.saved = hidden.detach(), True
            slot.ready = torch.cuda.Event()
            slot.ready.record(torch.cuda.current_stream(self.device))
            self._release_pending()
            self.stats.layers += 1
            return
        if slot.host is None or slot.host.numel() < n or slot.host.dtype != hidden.dtype:
            slot.host = torch.empty(n, dtype=hidden.dtype, device="cpu", pin_memory=self.cuda)
            self.host_generation += 1
        slot.shape, slot.dtype, slot.numel = tuple(hidden.shape), hidden.dtype, n
        slot.device_copy, slot.ready, slot.saved = None, None, True
        src = hidden.detach().reshape(-1)
        if self.cuda:
            # The copy stream reads `hidden` after the compute stream has written it; the
            # allocator must not hand its memory out again before that read has happened.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                slot.host[:n].copy_(src, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            self._release_pending()
            if index == len(self.slots) - 1:
                hidden.record_stream(self.copy_stream)  # the head follows: no next park releases it
            else:
                self._pending = (src, copied)
        else:
            slot.host[:n].copy_(src)
        self.stats.layers += 1
        self.stats.bytes_offloaded += n * hidden.element_size()

    def _release_pending(self) -> None:
        """Let the last parked input's device memory go: the compute stream's later work waits
        for its copy to the host, so the allocator may reuse the block in stream order."""
        if self._pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending[1])
            self._pending = None

    def _issue_reload(self, index: int) -> bool:
        """Start copying layer `index`'s input back on the copy stream; False if out of memory."""
        slot = self.slots[index]
        if not slot.saved or slot.device_copy is not None:
            return True
        try:
            # Allocated on the compute stream, which will use and free it.
            buf = torch.empty(slot.numel, dtype=slot.dtype, device=self.device)
        except torch.cuda.OutOfMemoryError:
            return False
        # Wait until the compute stream is past earlier users of this memory.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            buf.copy_(slot.host[: slot.numel], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        slot.device_copy, slot.ready = buf, ev
        return True

    def _fetch(self, index: int) -> torch.Tensor:
        """Layer `index`'s input on the device, usable on the compute stream."""
        slot = self.slots[index]
        self._release_pending()
        if not slot.saved:
            raise RuntimeError(f"layer {index}'s input was not offloaded in this forward pass")
        if not self.cuda:
            out = slot.host[: slot.numel].clone()
        else:
            if slot.device_copy is None:
                self.stats.reloads_waited += 1
                if not self._issue_reload(index):
                    raise torch.cuda.OutOfMemoryError(f"no device memory to reload layer {index}'s input")
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
            out = slot.device_copy
        slot.device_copy, slot.ready, slot.saved = None, None, False
        return out.view(slot.shape)

    def _prefetch_before(self, index: int) -> None:
        """Double buffering: start reloading the previous layer's input now."""
        if not self.cuda or self._step_mode != "double" or index == 0:
            return
        if not self._issue_reload(index - 1):
            self._step_mode = self.stats.mode = "single"
            self.stats.fell_back = "out of memory allocating the second buffer"


def second_buffer_short(second: int, free: int, allocated: int, measured: Optional[tuple[int, str, int]]) -> str:
    """Why a step cannot afford double buffering's second buffer of `second` bytes ("" when it
    can), given what the process can still allocate (`free`) and has allocated.

    `measured` is the last measured step's (peak allocated bytes, its mode, its second
    buffer's bytes), or None before any step was measured. Free memory at the start of a step
    does not see the step's own working set (the loss's logits chunks, a layer's recompute),
    so once a step was measured its peak decides: a single-buffered step's peak had no second
    buffer in it, a double-buffered one's had one of its own size."""
    margin = DOUBLE_BUFFER_MARGIN
    if measured is None:
        if free < second + margin:
            return f"free VRAM {free / 2**20:.0f} MiB < {(second + margin) / 2**20:.0f} MiB for the second buffer"
        return ""
    peak, mode, measured_second = measured
    estimate = peak + (second if mode == "single" else max(0, second - measured_second))
    ceiling = allocated + free
    if estimate + margin > ceiling:
        return (
            f"the last step's peak {peak / 2**20:.0f} MiB with a second buffer needs "
            f"{(estimate + margin) / 2**20:.0f} MiB of {ceiling / 2**20:.0f} MiB"
        )
    return ""


def attention_keep_bytes(lengths, config, dtype: torch.dtype, layers: int) -> int:
    """Device bytes that keeping every layer's attention output (and its log-sum-exp) for the
    recompute needs for a batch of documents of these `lengths`; 0 when it would not pay,
    i.e. when the attention forward is under ATTENTION_KEEP_MIN_SHARE of the layer's
    projection matmuls (so only long documents keep anything)."""
    h = config.hidden_size
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    d = getattr(config, "head_dim", None) or h // hq
    inter = getattr(config, "intermediate_size", 0) or 0
    tokens = sum(lengths)
    if tokens == 0 or layers == 0:
        return 0
    # Causal attention forward: 2 matmuls x 2 FLOPs x d x heads x L^2 / 2 per document.
    attention = 2.0 * d * hq * sum(n * n for n in lengths)
    projections = 2.0 * tokens * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter)
    if attention < ATTENTION_KEEP_MIN_SHARE * projections:
        return 0
    per_layer = tokens * hq * d * torch.finfo(dtype).bits // 8 + tokens * hq * 4
    return layers * per_layer


def free_device_bytes(device) -> int:
    """Bytes this process can still allocate: the driver's free memory plus the caching
    allocator's unused blocks, bounded by a per-process cap (set_per_process_memory_fraction)."""
    device = torch.device(device)
    if device.index is None:  # the memory queries below want an index, not plain "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    available = free + (reserved - allocated)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        cap = int(get_fraction(device) * total)
        available = min(available, cap - allocated)
    return max(0, available)


class OffloadedLayer(torch.autograd.Function):
    """forward(offloader, index, fn, anchor, hidden) -> fn(hidden), with hidden parked on the host."""

    @staticmethod
    def forward(ctx, offloader: ActivationOffloader, index: int, fn: Callable, anchor, hidden):
        ctx.offloader, ctx.index, ctx.fn = offloader, index, fn
        ctx.rng = RngState.capture(hidden.device) if offloader.keep_rng else None
        kept = offloader.slots[index].attention
        if offloader._early_release:  # a long single-buffered row: the previous input goes now
            offloader._release_pending()
        with torch.no_grad(), _passing(kept, "keep" if offloader._keep_attention else None) as extra:
            out = fn(hidden, **extra)
        if kept.outputs:
            offloader.stats.attention_layers += 1
        offloader._park(index, hidden)
        if isinstance(out, tuple):  # older decoder layers return (hidden, ...)
            ctx.tuple_out = len(out)
            return out[0]
        ctx.tuple_out = 0
        return out

    @staticmethod
    def backward(ctx, grad_out):
        off: ActivationOffloader = ctx.offloader
        hidden = off._fetch(ctx.index)
        off._prefetch_before(ctx.index)
        need_dx = ctx.needs_input_grad[4]
        hidden = hidden.detach().requires_grad_(need_dx)
        kept = off.slots[ctx.index].attention
        with (
            torch.enable_grad(),
            ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext(),
            _passing(kept, _recompute_mode(kept, off, ctx.fn)) as extra,
            recompute.recomputing(off.lean_recompute),
        ):
            out = ctx.fn(hidden, **extra)
        if ctx.tuple_out:
            out = out[0]
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        if ctx.index == 0:
            off._measure_step()
        dx = hidden.grad if need_dx else None
        return None, None, None, None, dx


def _recompute_mode(kept: KeptAttention, off: ActivationOffloader, fn: Callable) -> Optional[str]:
    """How the recompute hands `kept` to the layer's attention: "reuse" its kept outputs, or
    "recompute" (outputs made here belong to this backward alone, so the attention backward may
    write dQ into its output's memory), or not at all (fast_paths.keep_attention false, or a layer
    function that takes no keyword arguments: transformers' decoder layers all do)."""
    if kept.outputs:
        return "reuse"
    return "recompute" if off.keep_attention_allowed and _takes_kwargs(fn) else None


def _takes_kwargs(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@contextlib.contextmanager
def _passing(kept: KeptAttention, mode: Optional[str]):
    """The layer kwargs that hand `kept` to its attention calls in `mode` ("keep", "reuse" or "recompute");
    none when there is nothing to keep or reuse (the layer then runs exactly as without it)."""
    if mode is None:
        yield {}
        return
    kept.mode = mode
    try:
        yield {KEPT_KWARG: kept}
    finally:
        kept.mode = None
        if mode == "reuse":
            kept.outputs.clear()  # whatever the recompute did not take is not needed any more


@dataclass
class RngState:
    """RNG states at a layer's forward, so the recompute draws the same dropout masks
    (as torch.utils.checkpoint does; reading them asks the device nothing)."""

    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> "RngState":
        cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda_state, device)

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else [], enabled=True):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def decoder_layers(model) -> list:
    """The checkpointed decoder layers of a (PEFT-wrapped) transformers causal LM."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
