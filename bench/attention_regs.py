"""Registers and spills of the attention kernels on sm_90a, compiled offline: `python -m bench.attention_regs`.

Compiles engine.kernels.varlen_attention's forward, dK/dV and dQ kernels (causal, bf16, GQA group
4, strides divisible by 16 as a model's q/k/v views have) for Hopper with this machine's Triton,
with no GPU: Triton's own ptxas run makes the cubin, and the cuobjdump that ships with Triton reads
its register count and spill stores. Each candidate config of the short and long lists is listed,
and `--tuning old,new` puts the dK/dV kernel's carried addresses (old) beside the rebuilt ones
(new). A config that spills pays local-memory traffic on every step of its inner loop, which is
what the long-document lists avoid. Counts move with the Triton and ptxas versions; the one on the
GPU host may differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton

# Pointers to fp32 (softmax statistics); the other upper-case arguments are bf16 tensors or int32 tables.
_FP32_PTRS = ("LSE", "DELTA")
_INT_PTRS = ("CU", "TBL_A", "TBL_B")
_FLOATS = ("sm_scale", "mul_a", "mul_b")
# Integer arguments that are not strides (no divisibility by 16 to assume).
_PLAIN_INTS = ("window", "long_docs", "kv0", "T")


def _signature(fn, constexprs):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in _FLOATS:
            sig[name] = "fp32"
            continue
        if name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in _INT_PTRS:
            sig[name] = "*i32"
        elif name.isupper():
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
            if name in _PLAIN_INTS:
                continue
        attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(fn, constexprs: dict, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """{"registers": int, "spill_bytes": int, "shared_bytes": int} of `fn` compiled for sm_<arch>
    with `constexprs` (an H100 gives a block at most 227 KiB of shared memory)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    sig, attrs = _signature(fn, constexprs)
    src = ASTSource(fn, sig, constexprs, attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    if regs is None:
        raise RuntimeError(f"cuobjdump printed no register count:\n{out}")
    # cuobjdump reports the stack frame, which is where spilled registers go (0 when nothing spills).
    spill = int(stack.group(1)) if stack else 0
    return {"registers": int(regs.group(1)), "spill_bytes": spill, "shared_bytes": kernel.metadata.shared}


def kernel_configs(kinds=("fwd", "dkdv", "dq"), head_dims=(64, 128), fixed: bool = False):
    """(kind, head_dim, bucket, config) for every candidate of the short and long lists, or with
    `fixed` each kind's untuned config (_DEFAULTS: what head dims past the autotuned ones run)."""
    from engine.kernels import varlen_attention as va
    from engine.kernels.varlen_attention_configs import _qcfg

    if fixed:
        for kind in kinds:
            for d in head_dims:
                bm, bn, warps, stages = va._DEFAULTS[kind][d]
                cfg = va._cfg(bm, bn, warps, stages) if kind == "dkdv" else _qcfg(bm, bn, warps, stages)
                yield kind, d, "fixed", cfg
        return
    lists = {
        "fwd": (va._FWD_CONFIGS, va._FWD_LONG_CONFIGS),
        "dkdv": (va._DKDV_CONFIGS, va._DKDV_LONG_CONFIGS),
        "dq": (va._DQ_CONFIGS, va._DQ_LONG_CONFIGS),
    }
    for kind in kinds:
        short, long = lists[kind]
        for d in head_dims:
            for bucket, table in (("short", short), ("long", long)):
                for cfg in table.get(d, []):
                    yield kind, d, bucket, cfg


def measure(kind: str, d: int, cfg, tuning: str = "new", group: int = 4, arch: int = 90) -> dict:
    from engine.kernels import varlen_attention as va

    fn = {"fwd": va._attn_fwd, "dkdv": va._attn_bwd_dkdv, "dq": va._attn_bwd_dq}[kind]
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_A=bn if kind == "dkdv" else bm,
        CAUSAL=True,
        HAS_WINDOW=False,
        HAS_SOFTCAP=False,
        HAS_SINKS=False,
        DOT_PREC=None,
        REBUILD_ADDR=tuning == "new",
        FUSED_DELTA=False,  # dQ reading delta (a short-document launch makes it: one [rows, D] load more)
        BLOCK_M=bm,
        BLOCK_N=bn,
    )
    pack = cfg.kwargs.get("PACK")
    if pack is not None:  # the query-block kernels' GQA packing (varlen_attention_configs.PACK_ENV)
        constexprs["PACK"] = pack
    usage = resource_usage(fn, constexprs, cfg.num_warps, cfg.num_stages, arch)
    row = dict(kind=kind, head_dim=d, block_m=bm, block_n=bn, warps=cfg.num_warps, stages=cfg.num_stages)
    return {**row, **({"pack": pack} if pack is not None else {}), **usage}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="fwd,dkdv,dq")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--tuning", default="new", help="new, old, or both (dK/dV addresses: rebuilt or carried)")
    p.add_argument("--fixed", action="store_true", help="the untuned configs (_DEFAULTS) instead of the lists")
    p.add_argument("--group", type=int, default=4, help="GQA group (query heads per key/value head)")
    p.add_argument("--arch", type=int, default=90, help="sm_<arch>: 90 Hopper, 89 Ada (RTX 40), 86 Ampere (RTX 30)")
    args = p.parse_args(argv)
    tunings = ("old", "new") if args.tuning == "both" else (args.tuning,)
    seen = set()
    dims = tuple(int(x) for x in args.head_dims.split(","))
    for kind, d, bucket, cfg in kernel_configs(args.kinds.split(","), dims, args.fixed):
        for tuning in tunings if kind == "dkdv" else ("new",):
            ident = (kind, d, tuning, str(cfg))
            if ident in seen:
                continue
            seen.add(ident)
            row = measure(kind, d, cfg, tuning, args.group, args.arch)
            row.update(bucket=bucket, tuning=tuning, arch=args.arch, triton=triton.__version__)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
