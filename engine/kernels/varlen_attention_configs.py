"""Launch lists of the varlen attention kernels (engine.kernels.varlen_attention): which tile sizes,
warps and pipeline stages each kernel may run with, and how one is picked.

A *launch list* is a short list of `triton.Config` candidates (BLOCK_M, BLOCK_N, num_warps,
num_stages) per head dim for one kernel: forward ("fwd"), the split backward's dK/dV ("dkdv") and
dQ ("dq"). With autotuning on (a GPU, TUNESMITH_ATTN_AUTOTUNE not 0) `_tuned` wraps a kernel in
Triton's autotuner, which ranks the head dim's list once per process per autotune key (head dim,
GQA group, flags, the long-document bucket), never per shape; otherwise `_fixed` returns one fixed
config (`_DEFAULTS`, the long lists' first entries, the interpreter's small tiles, or blocks a test
pins). Every tile that indexes a block table is one of TABLE_BLOCKS, the sizes
engine.fastpath.packed builds tables for.

Long documents have their own lists because their time goes elsewhere: packed short documents
(W1-W3, LogNormal lengths under 2,048 tokens) are mostly diagonal blocks, masked or cut at a
document's end, where a big tile wastes work, while one long document (W6: 32,768 tokens) is
mostly the unmasked middle of the causal triangle, where big tiles, 8 warps and deeper pipelines
pay. Keying the autotuner on `long_docs` (the longest document at least LONG_DOCUMENT tokens)
keeps one bucket's winner from being reused for the other.

TUNESMITH_ATTN_TUNING=old (`tuning()`) brings back the launch choices of before 2026-12-02 so a
benchmark can time before and after in one process. No Triton kernel is defined here; the kernels
and the autograd Function stay in engine.kernels.varlen_attention (and the one-pass backward's own
list in engine.kernels.varlen_attention_bwd).
"""

from __future__ import annotations

import os
from typing import Optional

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Block sizes the GPU configs use; tables for both are passed so autotuning may pick either.
# (engine.fastpath.packed precomputes tables for exactly these sizes when a batch moves to the GPU.)
TABLE_BLOCKS = (64, 128)
# The widest head dim the kernels tile, and the widest the autotuner ranks candidates for. Past
# 256 (Gemma-4's global layers: 512) a [BLOCK, D] fp32 accumulator fills the registers, so the
# tiles are 32 or 16 rows, which no table of TABLE_BLOCKS serves: those launches take their
# fixed config (_DEFAULTS), with a table built for its block.
MAX_HEAD_DIM = 512
AUTOTUNED_MAX_HEAD_DIM = 256


def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _qcfg(bm, bn, warps, stages, pack=1):
    """A query-block kernel's candidate (forward, dQ): BLOCK_M positions of PACK query heads that
    share one key/value head, so a program's tile has PACK * BLOCK_M rows and reads each K/V block
    once for all of them (see PACK_ENV)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "PACK": pack}, num_warps=warps, num_stages=stages)


# GQA packing of the query-block kernels (forward and dQ). Packed short documents (W1-W3) leave
# most of a 128-row tile masked on the diagonal, and every query head re-reads its group's K/V: a
# 64-position block of two heads is a 128-row tile with the masking of a 64-row one and half the
# K/V reads. TUNESMITH_ATTN_PACK: unset or "1" lets the autotuner rank packed candidates beside the
# others (the untuned default packs nothing); "0" keeps only unpacked ones (the before of an A/B);
# an integer n >= 2 packs n heads in every launch whose group it divides (tests, the interpreter).
PACK_ENV = "TUNESMITH_ATTN_PACK"


def pack_setting() -> int:
    """TUNESMITH_ATTN_PACK as an int: 1 auto (default), 0 off, n >= 2 forced."""
    value = os.environ.get(PACK_ENV, "1").strip() or "1"
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{PACK_ENV}={value!r}: must be 0 (off), 1 (auto) or a head count >= 2") from None
    if n < 0:
        raise ValueError(f"{PACK_ENV}={value!r}: must be 0 (off), 1 (auto) or a head count >= 2")
    return n


def fixed_pack(group: int) -> int:
    """PACK for an untuned launch of a query-block kernel: the forced count where it divides the group, else 1."""
    n = pack_setting()
    return n if n >= 2 and group % n == 0 else 1


# Hopper-minded candidates, few on purpose: each distinct (head_dim, group, flags, dtype) tunes once.
_FWD_CONFIGS = {
    64: [_qcfg(128, 64, 4, 3), _qcfg(128, 128, 8, 3), _qcfg(64, 64, 4, 3), _qcfg(128, 64, 8, 4)]
    + [_qcfg(64, 64, 4, 3, pack=2), _qcfg(64, 128, 8, 3, pack=2), _qcfg(64, 64, 8, 3, pack=4)],
    128: [_qcfg(128, 64, 8, 3), _qcfg(128, 128, 8, 3), _qcfg(64, 64, 4, 3), _qcfg(128, 64, 4, 3)]
    + [_qcfg(64, 64, 8, 3, pack=2), _qcfg(64, 64, 8, 2, pack=2), _qcfg(64, 128, 8, 3, pack=2)],
    256: [_qcfg(64, 64, 4, 2), _qcfg(64, 64, 8, 2), _qcfg(64, 32, 4, 2)],
}
# dK/dV: BLOCK_N is the key block (table), BLOCK_M the query step (any ratio works).
_DKDV_CONFIGS = {
    64: [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3), _cfg(64, 64, 4, 2)],
    128: [_cfg(32, 128, 8, 2), _cfg(64, 128, 8, 2), _cfg(32, 64, 4, 3), _cfg(64, 64, 4, 2)],
    256: [_cfg(32, 64, 4, 1), _cfg(32, 64, 8, 2), _cfg(16, 64, 4, 2)],
}
# dQ: BLOCK_M is the query block (table), BLOCK_N the key step.
_DQ_CONFIGS = {
    64: [_qcfg(128, 32, 4, 3), _qcfg(128, 64, 8, 3), _qcfg(64, 64, 4, 3), _qcfg(64, 32, 4, 2)]
    + [_qcfg(64, 32, 4, 3, pack=2), _qcfg(64, 64, 8, 3, pack=2), _qcfg(64, 32, 8, 3, pack=4)],
    128: [_qcfg(128, 32, 8, 2), _qcfg(128, 64, 8, 2), _qcfg(64, 64, 4, 3), _qcfg(64, 32, 4, 2)]
    + [_qcfg(64, 32, 8, 2, pack=2), _qcfg(64, 64, 8, 2, pack=2)],
    256: [_qcfg(64, 32, 4, 2), _qcfg(64, 64, 8, 2), _qcfg(64, 16, 4, 2)],
}
_ALL_KEY = ["HEAD_DIM", "GROUP", "CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP"]

# Long documents (the longest at least LONG_DOCUMENT tokens, W6: one of 32,768) tune apart from
# packed short ones (W1-W3: LogNormal lengths under 2,048): their time is the unmasked middle of
# the causal triangle, so big tiles, 8 warps and deeper pipelines pay, and a 64-key block would
# read every later query twice as often. The candidates are chosen by ptxas on sm_90a (Triton 3.9,
# causal bf16, GROUP 4; `python -m bench.attention_regs`, bench/results/attention_regs.jsonl): the
# first entry of each list, the untuned default (TUNESMITH_ATTN_AUTOTUNE=0), spills no register,
# where the old head_dim-64 dK/dV default (32, 128, 4 warps) spills 368 bytes. The others (a few
# spill up to 200 bytes, the old default among them) are there for the autotuner to rank on the GPU.
# Head dims without a long list use the short one.
LONG_DOCUMENT = 4096
_FWD_LONG_CONFIGS = {
    64: [_qcfg(128, 128, 8, 3), _qcfg(128, 128, 8, 4), _qcfg(128, 64, 4, 4), _qcfg(128, 64, 4, 3)]
    + [_qcfg(128, 64, 8, 4)],
    128: [_qcfg(128, 64, 8, 3), _qcfg(128, 128, 8, 2), _qcfg(128, 128, 8, 3), _qcfg(128, 64, 8, 4)],
}
_DKDV_LONG_CONFIGS = {
    64: [_cfg(32, 128, 8, 3), _cfg(32, 128, 8, 5), _cfg(64, 128, 8, 2), _cfg(64, 128, 8, 3), _cfg(32, 128, 4, 3)],
    128: [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _cfg(32, 128, 8, 3), _cfg(64, 128, 8, 2)],
}
_DQ_LONG_CONFIGS = {
    64: [_qcfg(128, 64, 8, 3), _qcfg(128, 64, 8, 4), _qcfg(128, 128, 8, 3), _qcfg(128, 32, 4, 3)],
    128: [_qcfg(128, 64, 8, 2), _qcfg(128, 64, 8, 3), _qcfg(128, 32, 8, 2), _qcfg(128, 32, 8, 3)],
}

# "0" keeps the separate _bwd_delta kernel for packed short documents too (see fuse_delta), for bench's
# before/after; read per call.
FUSED_DELTA_ENV = "TUNESMITH_ATTN_FUSED_DELTA"


def fused_delta_on() -> bool:
    """On unless TUNESMITH_ATTN_FUSED_DELTA=0 (bench.ours's `fused_delta=false`)."""
    return os.environ.get(FUSED_DELTA_ENV, "1").strip() != "0"


def fuse_delta(longest: Optional[int]) -> bool:
    """Whether a call whose longest document is `longest` tokens (None: unknown) has its dQ kernel make
    delta = rowsum(dO * O) itself (and run before dK/dV) instead of a _bwd_delta launch: packed short
    documents, under LONG_DOCUMENT. It saves a pass over dO and one launch per layer (W1: 28 x ~45 us
    of a separate kernel that reads O and dO). Long documents keep _bwd_delta: there delta is a sliver
    of the backward, and the fused kernel's autotuning copies O once per candidate (restore_value), a
    long row's largest activation. Never with FUSED_DELTA_ENV=0 (fused_delta_on)."""
    return fused_delta_on() and longest is not None and longest < LONG_DOCUMENT


# TUNESMITH_ATTN_TUNING=old runs the launch choices of before 2026-12-02 (one candidate list for
# every document length, the dK/dV kernel's carried addresses) so bench.attention_micro can time
# before and after in one process; "new" (the default) is this module's choice. Read per call.
TUNING_ENV = "TUNESMITH_ATTN_TUNING"
TUNINGS = ("new", "old")


def tuning() -> str:
    """The launch choices in force: "new" or "old" (TUNESMITH_ATTN_TUNING)."""
    value = os.environ.get(TUNING_ENV, "new").strip().lower() or "new"
    if value not in TUNINGS:
        raise ValueError(f"{TUNING_ENV}={value!r}: must be one of {', '.join(TUNINGS)}")
    return value


def _nearest(table, d):
    return table[d] if d in table else table[min(table, key=lambda x: abs(x - d))]


def _prune(table, long_table=None):
    def prune(configs, named_args, **kwargs):
        d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        long_docs = kwargs.get("long_docs", named_args.get("long_docs", 0))
        if long_table is not None and long_docs and d in long_table:
            return long_table[d]
        return _packable(_nearest(table, d), kwargs.get("GROUP", named_args.get("GROUP", 1)))

    return prune


def _packable(configs, group: int):
    """The candidates whose PACK the GQA group and TUNESMITH_ATTN_PACK allow (kernels without PACK: all)."""
    setting = pack_setting()
    if setting == 1:
        allowed = None  # auto: every pack that divides the group
    else:  # off, or forced: that count where it divides the group (fixed_pack's rule)
        allowed = {setting if setting >= 2 and group % setting == 0 else 1}
    kept = [
        c
        for c in configs
        if "PACK" not in c.kwargs
        or (group % c.kwargs["PACK"] == 0 and (allowed is None or c.kwargs["PACK"] in allowed))
    ]
    return kept or [c for c in configs if c.kwargs.get("PACK", 1) == 1]


# Timed runs per candidate: about this many milliseconds of them, at least one, at most MAX_RUNS.
BENCH_MS = 20.0
MAX_RUNS = 100


def _short_bench(kernel_call, quantiles):
    """Time one candidate config for the autotuner: one untimed run (compile, warm), then about
    BENCH_MS of timed runs; the quantiles of their times in ms (the mean without quantiles).

    Not triton.testing.do_bench: it allocates a 256 MB buffer to flush the L2 cache before every
    run, and the autotuner ranks during the first step, often at the step's memory peak (on W7's
    long row that buffer was live at the highest point: 256 MiB of a 16 GiB cap), and it runs a
    candidate at least seven times, seconds each on a 150k-token document. A ranking needs
    neither: the candidates see the same warm cache.
    """
    import torch

    kernel_call()
    times = []
    budget = None
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel_call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if budget is None:  # runs that fill about BENCH_MS, from the first timed one
            budget = max(1, min(MAX_RUNS, int(BENCH_MS / max(times[0], 1e-3))))
        if len(times) >= budget:
            break
    t = torch.tensor(times, dtype=torch.float64)
    if quantiles is None:
        return float(t.mean())
    return [float(x) for x in torch.quantile(t, torch.tensor(list(quantiles), dtype=torch.float64))]


def _tuned(kernel, table, key=_ALL_KEY, reset_to_zero=None, long_table=None, restore_value=None):
    # reset_to_zero: buffers a kernel adds into (atomics), zeroed before each timed config.
    # restore_value: inputs a kernel may overwrite, copied before and put back after each timed config.
    # long_table: candidates when the kernel's `long_docs` argument (part of `key`) is set.
    every = [c for cs in table.values() for c in cs]
    if long_table is not None:
        every += [c for cs in long_table.values() for c in cs]
    opts = dict(configs=every, key=key, prune_configs_by={"early_config_prune": _prune(table, long_table)})
    if reset_to_zero:
        opts["reset_to_zero"] = reset_to_zero
    if restore_value:
        opts["restore_value"] = restore_value
    try:
        return triton.autotune(**opts, do_bench=_short_bench)(kernel)
    except TypeError:  # a Triton without the do_bench hook
        return triton.autotune(**opts)(kernel)


# The autotune key of the kernels that tune long documents apart.
_LONG_KEY = _ALL_KEY + ["long_docs"]

# Fixed configs used when autotuning is off (interpreter, TUNESMITH_ATTN_AUTOTUNE=0, or tests
# that pin blocks) and for head dims past AUTOTUNED_MAX_HEAD_DIM: {kernel: (BLOCK_M, BLOCK_N,
# num_warps, num_stages)} per head dim. The 512 entries were chosen by ptxas on sm_90a (Triton 3.9,
# causal bf16, GROUP 2, `python -m bench.attention_regs --head-dims 512 --fixed`): forward and dQ
# spill 48 and 32 bytes, dK/dV nothing, in at most 128 KiB of shared memory; 64-row tiles spill
# 0.2-2.3 KB, and 16 warps cap a thread at 128 registers and spill more.
_DEFAULTS = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 4, 2), 512: (32, 32, 8, 2)},
    "dkdv": {64: (32, 128, 4, 3), 128: (32, 128, 8, 2), 256: (32, 64, 4, 1), 512: (32, 16, 8, 1)},
    "dq": {64: (128, 32, 4, 3), 128: (128, 32, 8, 2), 256: (64, 32, 4, 2), 512: (32, 32, 8, 2)},
}
_INTERPRET_BLOCKS = (16, 16)


def _first_configs(table):
    return {d: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for d, (c, *_) in table.items()}


# Untuned long-document configs: the first candidate of each long list.
_LONG_DEFAULTS = {
    "fwd": _first_configs(_FWD_LONG_CONFIGS),
    "dkdv": _first_configs(_DKDV_LONG_CONFIGS),
    "dq": _first_configs(_DQ_LONG_CONFIGS),
}


def shrink(kind: str, config: tuple[int, int, int, int]) -> Optional[tuple[int, int, int, int]]:
    """The next smaller fixed config after `config` (BLOCK_M, BLOCK_N, num_warps, num_stages) did
    not fit the card's shared memory, or None at the smallest.

    The fixed configs are sized for Hopper's 227 KiB a block; an RTX card (sm_86, sm_89, sm_120)
    gives 99 KiB, where head dim 256's and 512's do not fit (`python -m bench.attention_regs
    --fixed --arch 89`). One pipeline stage first, then the step block halved, then the table
    block (BLOCK_M for fwd/dq, BLOCK_N for dK/dV), each down to 16 rows (tl.dot's least)."""
    bm, bn, warps, stages = config
    if stages > 1:
        return bm, bn, warps, 1
    table_is_n = kind in _KEY_BLOCK_KINDS
    step, table = (bm, bn) if table_is_n else (bn, bm)
    if step > 16:
        step //= 2
    elif table > 16:
        table //= 2
    else:
        return None
    return (step, table, warps, 1) if table_is_n else (table, step, warps, 1)


def _use_autotune() -> bool:
    return not INTERPRET and os.environ.get("TUNESMITH_ATTN_AUTOTUNE", "1") != "0"


# Kernels whose programs own key blocks (their table is indexed by BLOCK_N); the others own query blocks.
_KEY_BLOCK_KINDS = ("dkdv", "onepass")


def _fixed(
    kind: str, d: int, blocks: Optional[tuple[int, int]], fp32: bool = False, defaults=None, long_docs: bool = False
):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Pinned `blocks` are (table block, step block):
    the table block is BLOCK_M for fwd/dq and BLOCK_N (key block) for dkdv and onepass.
    `defaults` ({head_dim: config}) replaces _DEFAULTS[kind] (the one-pass backward's own table);
    `long_docs` takes _LONG_DEFAULTS[kind] where it has the head dim."""
    if blocks is not None:
        if kind in _KEY_BLOCK_KINDS:
            return blocks[1], blocks[0], 4, 2
        return blocks[0], blocks[1], 4, 2
    if INTERPRET:
        return _INTERPRET_BLOCKS[0], _INTERPRET_BLOCKS[1], 4, 1
    if fp32:
        # fp32 on a GPU is for exact checks, not speed: small tiles fit shared memory at D=256,
        # smaller ones at 512.
        return (16, 16, 4, 1) if d > 256 else (32, 32, 4, 1)
    if defaults is not None:
        return _nearest(defaults, d)
    if long_docs and d in _LONG_DEFAULTS.get(kind, {}):
        return _LONG_DEFAULTS[kind][d]
    return _nearest(_DEFAULTS[kind], d)
