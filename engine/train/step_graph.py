"""CUDA graphs over a micro-batch's forward and backward (`fast_paths.cuda_graphs`).

On a small model a training step is bound by the host, not the GPU: W1's profile shows about
4,600 kernel launches a step at about 50 us of Python and launch work each, while the GPU waits
(bench/results/levers.md). A CUDA graph records one micro-batch's launches once; a replay issues
them all with one call.

A graph replays fixed shapes and addresses, so each micro-batch is mapped to a *bucket*:

- its token count rounded up (`bucket_tokens`); the rest is a padding document of token 0 with
  no trained target, attended on its own like any document, so it changes no real token;
- its document count rounded up to a power of two: trailing empty documents in cu_seqlens, which
  no attention block table names;
- whether its longest document reaches the attention's long-document launch lists
  (engine.kernels.varlen_attention.LONG_DOCUMENT), which choose different kernels.

The micro-batch's ids, targets, positions, cu_seqlens and attention block tables are copied into
its bucket's static tensors (the tables padded with rows of document -1, which the kernels skip:
the grids stay the size of the bucket's bound). The loss is captured as the sum over trained
targets times a device scalar holding 1/normalizer, so one graph serves every step's normalizer.
The LoRA gradients accumulate in place into gradient tensors the graphs own, handed back to the
parameters before each forward (an optimizer's `zero_grad(set_to_none=True)` drops them).

The first micro-batch of a bucket's shapes runs eagerly, on the graphs' own stream, exactly as the
graph will: it warms up Triton's autotuner, cuBLAS and the allocator there, as capture needs. The
next one of those shapes is captured (a bucket differing only in its document count at once),
then replayed; later ones are replayed. Inside a capture the LoRA layers build their cast adapter
weights afresh (engine.fastpath.lora_group.uncached), so every replay reads the adapters the
optimizer left, never a copy cached outside the graph. What the capture counted (fast-path
calls, fallbacks) is counted again at each replay.

With offloaded checkpointing the graph holds the copies to and from the offloader's pinned host
buffers and the copy stream's events; its per-step choices (double or single buffering, keeping
attention outputs) are the ones made at capture, for the bucket's shapes. A graph whose host
buffers were replaced since (a larger bucket grew them) is captured again.

Where a graph cannot be used (`graph_choice`: CPU, several processes, a method other than SFT,
...) the run is eager and the report says why; where it stops being usable mid-run (the memory
recovery moves the embedding table to host memory) the micro-batch runs eagerly, counted as a
fallback with its reason, never an error. A memory setting the recovery lowers drops the graphs;
they are captured again under it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.config import AUTO
from engine.counters import count_fallback, current
from engine.data.collate import IGNORE_INDEX, PackedBatch
from engine.fastpath.packed import PackedSeqInfo
from engine.fastpath.streams import side_stream

MIN_DOC_BUCKET = 8  # fewer distinct buckets for batches of a few documents
# fast_paths.cuda_graphs "auto": on below this hidden size, where steps are launch-bound (W1's,
# W2's). Above it a step's kernels are long enough to hide the host, and a graph's pool would
# only hold memory beside the allocator's cache.
AUTO_MAX_HIDDEN = 4096
# ... and on cards with at least this much memory: a graph's private pool holds its micro-batch's
# working set beside the allocator's cache, and a bucket's eager warm-up runs while earlier graphs
# hold theirs (W1 on the H200: 4.56 GiB reserved against 3.07 eager, the same 2.94 GiB peak in use),
# room a laptop's card may not have.
AUTO_MIN_MEMORY = 16 * 2**30


def bucket_tokens(n: int) -> int:
    """`n` rounded up to a multiple of 2^(floor(log2 n) - 3) (at least 64): at most 12.5% of
    padding, about eight buckets per doubling. Best-fit packed rows are nearly full, so a run
    sees one or two."""
    step = max(64, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def bucket_docs(n: int) -> int:
    """`n` documents rounded up to a power of two (at least MIN_DOC_BUCKET)."""
    return max(MIN_DOC_BUCKET, 1 << max(0, n - 1).bit_length())


def device_memory(device) -> Optional[int]:
    """Bytes this process may use on the CUDA `device` (its total under any per-process cap, as
    an emulated smaller card sets); None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * fraction(index)) if fraction is not None else total


def graph_choice(
    setting,
    *,
    device,
    objective: str,
    distributed: bool,
    prepared,
    model,
    lora_dropout: float,
    memory: Optional[int] = None,
):
    """(whether this run's micro-batches go through CUDA graphs, the report line's reason).
    `memory`: device_memory(device), for auto's rule on small cards (None: no rule)."""
    from engine.fastpath.host_embed import host_embedding
    from engine.peft_model import hf_model
    from engine.train.step import documents_alone

    if setting is False:
        return False, "disabled in config"
    device = torch.device(device)
    base = hf_model(model)
    cfg = base.config
    why = None
    if device.type != "cuda":
        why = "CUDA graphs need a CUDA GPU"
    elif objective != "sft":
        why = f"{objective} runs more than the next-token loss in a step (reference or sampling passes)"
    elif distributed:
        why = "several processes: DDP's and FSDP's hooks run between the kernels"
    elif host_embedding(base) is not None:
        why = "the embedding table is in host memory: a host gather per batch"
    elif documents_alone(base):
        why = f"{cfg.model_type} runs each document alone"
    elif str(prepared.report.get("cached_metadata", "on")).startswith("off"):
        # Every layer then builds its lengths and tables from host lists: a copy a capture cannot hold.
        why = "the packed metadata is rebuilt in every layer from host lists (cached_metadata off)"
    elif str(prepared.report.get("moe_grouping", "")).startswith("on"):
        why = "MoE routing sizes its expert groups on the host"
    elif getattr(cfg, "quantization_config", None) is not None:
        why = "quantized bases are not captured (not yet checked against the eager step)"
    elif lora_dropout > 0 or float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        why = "dropout draws random numbers that the recompute must draw again"
    if why is not None:
        return False, why
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    if setting == AUTO and hidden >= AUTO_MAX_HIDDEN:
        return False, f"auto: hidden size {hidden:,} >= {AUTO_MAX_HIDDEN:,}, the step's kernels hide the host"
    if setting == AUTO and memory is not None and memory < AUTO_MIN_MEMORY:
        return False, (
            f"auto: {memory / 2**30:.1f} GiB on the card (< {AUTO_MIN_MEMORY / 2**30:.0f}): a graph's memory "
            "pool would take room the run may need"
        )
    return True, "set in config" if setting is True else f"auto: hidden size {hidden:,}, launch-bound"


# Block sizes an attention launch may tile documents with: the autotuned lists' (TABLE_BLOCKS), the
# fixed configs' (engine.kernels.varlen_attention_configs._fixed: 64/128; 32 in fp32, 16 under the
# interpreter). A bucket holds a static table for each; a capture records which it read, and only
# those are refilled before a replay.
STATIC_BLOCKS = (16, 32, 64, 128)


def _place(frames) -> str:
    """' at <file>:<line>' of the innermost of `frames` (traceback.FrameSummary) outside torch and
    contextlib, the path shortened to its package (transformers/..., engine/...); or ""."""
    import os

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    where = ""
    for frame in frames:
        if frame.filename.startswith(torch_dir) or os.path.basename(frame.filename) in ("contextlib.py", "warnings.py"):
            continue
        path = frame.filename.replace("\\", "/")
        for root in ("/site-packages/", "/dist-packages/"):
            if root in path:
                path = path.split(root, 1)[1]
                break
        else:
            for root in ("/engine/", "/studio/"):
                if root in path:
                    path = root[1:] + path.split(root, 1)[1]
                    break
        where = f" at {path}:{frame.lineno}"
    return where


def failed_at(exc: BaseException) -> str:
    """Where `exc` was raised, as ' at <file>:<line>': the innermost frame outside torch, or "".

    A capture fails at the op that cannot be captured (a host tensor copied in, a read back), and
    that op is almost always called from a model's code, not torch's: naming the frame in the
    counted reason tells the user which family's code stopped the graph, with no log to dig in."""
    import traceback

    return _place(traceback.extract_tb(exc.__traceback__))


# What torch's sync debug mode warns at a synchronizing op (c10's warn_or_error_on_sync). The
# whole text: the mode's first setting in a process also warns, once, that it "does not yet detect
# all synchronizing operations", and that notice is no read back (LongCat-Flash's capture was
# named by it: the watch's own line).
_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncWatch:
    """Within it, the first read back to the host (a synchronizing CUDA op) is recorded with its
    place: `place` is ' at <file>:<line>', or "" while none was seen.

    Some reads back do not raise where they are made during a capture: the capture is spoiled and
    fails only at its end ("operation failed due to a previous error during capture", LongCat-Flash's
    stock experts' `nonzero`), where failed_at can only name the capture itself. torch's sync debug
    mode warns at each synchronizing op, from the op's own call; the warning's stack names the
    model code that read back. Used around a capture only: code that reads back eagerly but not
    while a stream captures (transformers' `is_tracing` checks) is quiet there."""

    def __init__(self):
        self.place = ""

    def where(self, exc: BaseException) -> str:
        """The place of a capture that failed with `exc`: the read back seen, which is the cause
        wherever the failure surfaced, else where `exc` was raised (failed_at)."""
        return f" (read back{self.place})" if self.place else failed_at(exc)

    def __enter__(self):
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        # Every time, not once per place: a later run's capture in this process must see it too.
        warnings.filterwarnings("always", message=_SYNC_WARNING)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            # The mode's own warning (torch may add " (Triggered internally at ...)"): kept, not shown.
            if str(message).startswith(_SYNC_WARNING):
                if not self.place:
                    import traceback

                    self.place = _place(traceback.extract_stack()[:-1]) or f" at {filename}:{lineno}"
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._mode = None
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> bool:
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)
        return False


class _StaticInfo(PackedSeqInfo):
    """A bucket's packed metadata: its block tables are the static ones, filled per micro-batch.
    A table it does not hold is an error (the capture fails and the run stays eager), never one
    built from lengths that are not the micro-batch's."""

    def block_table(self, kind: str, block: int):
        try:
            table = self._tables[(kind, block)]
        except KeyError:
            raise RuntimeError(f"a CUDA graph bucket has no attention table for {kind} blocks of {block}") from None
        self.requested.add((kind, block))
        return table


class _Bucket:
    """One bucket's static inputs, its graph and its captured loss."""

    def __init__(self, key: tuple[int, int, bool], device: torch.device):
        from engine.kernels.varlen_attention import LONG_DOCUMENT, TABLE_BLOCKS

        tokens, docs, long_docs = key
        self.key = key
        # One int64 buffer (ids, targets, positions) and one int32 buffer (cu_seqlens, block
        # tables): two host-to-device copies a micro-batch.
        self.wide = torch.zeros(3 * tokens, dtype=torch.int64, device=device)
        blocks = sorted(set(TABLE_BLOCKS) | set(STATIC_BLOCKS))
        self.table_shapes = [((kind, block), -(-tokens // block) + docs) for block in blocks for kind in ("q", "k")]
        narrow = docs + 1 + sum(2 * rows for _, rows in self.table_shapes)
        self.narrow = torch.zeros(narrow, dtype=torch.int32, device=device)
        ids, targets, positions = self.wide.view(3, tokens)
        cu = self.narrow[: docs + 1]
        # The grid and kernel choices: the bound of the bucket (kernels read the real lengths
        # from cu_seqlens; max_seqlen only picks the launch lists and sizes non-Triton grids).
        max_seqlen = tokens if long_docs else min(tokens, LONG_DOCUMENT - 1)
        # lengths: the micro-batch's, set by fill() for host-side choices made while a warm-up or
        # a capture runs (the offloader's keep-attention choice); a replay makes none.
        self.info = _StaticInfo([tokens], cu, max_seqlen, positions, tokens)
        self.info.requested = set()
        start = docs + 1
        for key_, rows in self.table_shapes:
            table = self.narrow[start : start + 2 * rows].view(rows, 2)
            self.info._tables[key_] = (table, rows)
            start += 2 * rows
        self.info._device_cache[str(device)] = self.info  # already on the device
        self.batch = PackedBatch(ids.unsqueeze(0), targets.unsqueeze(0), self.info, tokens, 0)
        self.version: object = None  # StepGraphs.version() when the graph was captured
        self.used: Optional[set] = None  # the tables the graph reads: None until captured (then all are filled)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.loss: Optional[torch.Tensor] = None
        self.counts: dict[str, int] = {}

    def fill(self, batch: PackedBatch) -> None:
        """Copy a host micro-batch into the static tensors (queued on the current stream)."""
        from engine.kernels.varlen_attention import host_block_table

        tokens, docs, _ = self.key
        n = batch.num_tokens
        lengths = [int(x) for x in batch.info.lengths]
        ids, targets, positions = batch.input_ids.reshape(-1), batch.targets.reshape(-1), batch.info.position_ids
        if n < tokens:  # the padding document
            pad = tokens - n
            ids = torch.cat([ids, torch.zeros(pad, dtype=torch.int64)])
            targets = torch.cat([targets, torch.full((pad,), IGNORE_INDEX, dtype=torch.int64)])
            positions = torch.cat([positions, torch.arange(pad, dtype=torch.int64)])
            lengths.append(pad)
        self.info.lengths = lengths
        cu = torch.full((docs + 1,), tokens, dtype=torch.int32)
        cu[0] = 0
        cu[1 : len(lengths) + 1] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
        parts = [cu]
        for key, rows in self.table_shapes:
            table = torch.zeros(rows, 2, dtype=torch.int32)
            table[:, 0] = -1
            if self.used is None or key in self.used:  # a table no graph reads is left empty
                real = host_block_table(lengths, key[1], key[0])
                table[: real.shape[0]] = real
            parts.append(table.reshape(-1))
        wide, narrow = torch.cat([ids, targets, positions]), torch.cat(parts)
        if self.wide.is_cuda:  # pinned: queued on the stream, the host does not wait
            wide, narrow = wide.pin_memory(), narrow.pin_memory()
        self.wide.copy_(wide, non_blocking=True)
        self.narrow.copy_(narrow, non_blocking=True)


class StepGraphs:
    """The run's CUDA graphs, one per bucket. `loss_fn(device batch, normalizer)` -> the scalar
    loss (sum over trained targets / normalizer) whose backward a micro-batch runs; `params`: the
    trainable parameters whose gradients the graphs accumulate into; `usable()` -> None, or why
    the graphs cannot run now (checked at each micro-batch)."""

    def __init__(
        self,
        loss_fn: Callable,
        params,
        device,
        usable: Callable[[], Optional[str]] = lambda: None,
        version: Callable[[], object] = lambda: None,
    ):
        self.loss_fn = loss_fn
        self.params = [p for p in params if p.requires_grad]
        self.device = torch.device(device)
        self.usable = usable
        # What a captured graph depends on beyond its bucket (the offloader's pinned host buffers:
        # ActivationOffloader.host_generation); a graph captured under another version is captured again.
        self.version = version
        self.buckets: dict[tuple[int, int, bool], _Bucket] = {}
        # (tokens, long documents) whose shapes an eager warm-up has run: a bucket of the same
        # shapes with another document count (its tables' length alone differs) is captured at once.
        self.warmed: set[tuple[int, bool]] = set()
        self.stream = side_stream(self.device, "graphs")  # the process's: see engine.fastpath.streams
        self.pool = None
        self.grads: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.inv_norm = torch.ones((), dtype=torch.float32, device=self.device)
        self.broken: Optional[str] = None  # why capture failed; the run stays eager from then on
        self.captures = 0
        self.replays = 0

    # -- the run's use ---------------------------------------------------------------------------
    def why_not(self) -> Optional[str]:
        """None when the next micro-batch can go through a graph, else why not."""
        return self.broken or self.usable()

    def forward_backward(self, batch: PackedBatch, normalizer) -> torch.Tensor:
        """Forward and backward of one host micro-batch (its gradients added to the parameters');
        the detached loss. Falls back to the eager step, counted, when the graphs cannot run."""
        why = self.why_not()
        if why is not None:
            count_fallback("cuda_graphs", why)
            self.reset()
            return self._eager(batch, normalizer)
        key = self.key(batch)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(key, self.device)
        self._attach_grads()
        bucket.fill(batch)
        self.inv_norm.fill_(1.0 / float(normalizer))
        shapes = (key[0], key[2])
        if shapes not in self.warmed:
            self.warmed.add(shapes)
            return self._warm_up(bucket)
        if bucket.graph is not None and bucket.version != self.version():
            bucket.graph = None  # its buffers were replaced: captured again below
        if bucket.graph is None:
            watch = SyncWatch()
            try:
                with watch:
                    self._capture(bucket)
            except Exception as exc:
                from engine.train.recovery import is_oom

                if is_oom(exc):
                    raise  # the step's memory recovery handles it (and calls reset)
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                self.broken = f"capture failed ({why}){watch.where(exc)}"
                self.reset()
                count_fallback("cuda_graphs", self.broken)
                return self._eager(batch, normalizer)
        bucket.graph.replay()
        self.replays += 1
        counters = current()
        for k, v in bucket.counts.items():
            counters[k] = counters.get(k, 0) + v
        return bucket.loss.clone()

    def reset(self) -> None:
        """Drop every graph and its memory (a memory setting changed, or the graphs cannot run)."""
        if not self.buckets and self.pool is None:
            return
        self.buckets.clear()
        self.warmed.clear()
        self.pool = None
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """The run is over: drop the graphs, their pool and the gradients they own."""
        self.reset()
        for p, g in self.grads or ():
            if p.grad is g:
                p.grad = None
        self.grads = None

    @staticmethod
    def key(batch: PackedBatch) -> tuple[int, int, bool]:
        from engine.kernels.varlen_attention import LONG_DOCUMENT

        tokens = bucket_tokens(batch.num_tokens)
        docs = len(batch.info.lengths) + (1 if tokens > batch.num_tokens else 0)
        return tokens, bucket_docs(docs), max(batch.info.lengths) >= LONG_DOCUMENT

    # -- inside ----------------------------------------------------------------------------------
    def _attach_grads(self) -> None:
        """Give each parameter its graph-owned gradient tensor (zeroed where it had none; its
        value copied where it had another)."""
        if self.grads is None:
            self.grads = [(p, torch.zeros_like(p) if p.grad is None else p.grad) for p in self.params]
        zero = []
        for p, g in self.grads:
            if p.grad is g:
                continue
            if p.grad is None:
                zero.append(g)
            else:
                g.copy_(p.grad)
            p.grad = g
        if zero:
            torch._foreach_zero_(zero)

    def _eager(self, batch: PackedBatch, normalizer) -> torch.Tensor:
        """The micro-batch without a graph, on the current stream."""
        dev = batch.to(self.device)
        loss = self.loss_fn(dev, normalizer)
        loss.backward()
        dev.info.free()
        return loss.detach()

    def _warm_up(self, bucket: _Bucket) -> torch.Tensor:
        """A bucket's first micro-batch (already in its static tensors): eagerly, exactly as the
        graph will run it, on the graphs' stream, so that what capture cannot do (autotuning,
        compiling for these shapes, allocating the offloader's host buffers, cuBLAS's workspace
        for the stream) is done."""
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        with torch.cuda.stream(self.stream):
            loss = self.loss_fn(bucket.batch, 1.0) * self.inv_norm
            loss.backward()
            loss = loss.detach()
        here.wait_stream(self.stream)
        loss.record_stream(here)  # read on this stream, made on the graphs'
        return loss

    def _capture(self, bucket: _Bucket) -> None:
        from engine.fastpath.lora_group import uncached

        graph = torch.cuda.CUDAGraph()
        counters = current()
        before = dict(counters)
        with counters.set_aside():
            # thread_local: the window's memory poll (engine.hardware.vram, another thread) may
            # ask the driver while a capture runs; only this thread's calls must not touch it.
            capture = torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local")
            with uncached(), capture:
                loss = self.loss_fn(bucket.batch, 1.0) * self.inv_norm
                loss.backward()
                bucket.loss = loss.detach()
            bucket.counts = {k: v - before.get(k, 0) for k, v in counters.items() if v != before.get(k, 0)}
        bucket.used = set(bucket.info.requested)
        bucket.version = self.version()
        if self.pool is None:
            self.pool = graph.pool()
        bucket.graph = graph
        self.captures += 1
        # The warm-up's activations were cached for the graphs' stream; the graph has its own pool.
        torch.cuda.empty_cache()
