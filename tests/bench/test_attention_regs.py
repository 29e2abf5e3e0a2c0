"""bench.attention_regs: the attention kernels compiled offline for sm_90a (no GPU), registers read
back from the cubin. W6's untuned long-document dK/dV config spills nothing; the 4-warp config it
replaced does (so the reading can tell the two apart). Runs in a child process: the test session's
Triton is in interpreter mode, which compiles nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import attention_regs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not os.path.exists(attention_regs._cuobjdump()), reason="this Triton ships no cuobjdump"
)

_PROBE = """
import json
from bench.attention_regs import measure
from engine.kernels import varlen_attention as va
new = measure("dkdv", 64, va._DKDV_LONG_CONFIGS[64][0], "new")
old = measure("dkdv", 64, va._cfg(*va._DEFAULTS["dkdv"][64]), "old")
print(json.dumps([new, old]))
"""


def test_w6_long_dkdv_default_does_not_spill_and_the_old_default_does():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    new, old = json.loads(done.stdout.strip().splitlines()[-1])
    assert (new["block_m"], new["block_n"], new["warps"]) == (32, 128, 8)
    assert new["spill_bytes"] == 0, new
    assert old["spill_bytes"] > 0, old


_PROBE_512 = """
import json
from bench.attention_regs import kernel_configs, measure
configs = kernel_configs(("fwd", "dkdv", "dq"), (512,), fixed=True)
rows = [measure(kind, d, cfg, "new", group=2) for kind, d, _, cfg in configs]
print(json.dumps(rows))
"""


def test_head_dim_512_fixed_configs_fit_an_h100():
    # Head dims past the autotuned ones launch their _DEFAULTS config untried: each must fit the
    # 227 KiB of shared memory an H100 block may have (past it the launch fails on the GPU), and
    # dK/dV, whose two [BLOCK_N, 512] fp32 accumulators are the heaviest, must not spill.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE_512], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["kind"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"fwd", "dkdv", "dq"}
    for row in rows.values():
        assert row["shared_bytes"] <= 227 * 1024, row
        assert row["spill_bytes"] <= 64, row
    assert rows["dkdv"]["spill_bytes"] == 0, rows["dkdv"]
