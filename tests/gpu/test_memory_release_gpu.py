"""Runs one after another in one process leave no device memory behind (the window trains several
times in one process; the bench measures `--repeat` runs in one process).

On an H100 the bench's W1 peak grew over three repeats in one process (2.01, 2.14, 2.20 GiB,
thirteenth session). This test found why (fourteenth session): each run left 64 MiB more
allocated (128, 192, 256 MiB after three runs), the cuBLAS workspace of the new CUDA stream each
run made for its graphs. Side streams are now the process's (engine.fastpath.streams).
The first run is a warm-up (the workspaces of the process's streams stay, once, by design); the
second and third must each end where the first ended. The allocation history that names what is left
is taken only after a failure: recorded from the start, its Python stacks broke the run with offload
off (sixteenth session, H100).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from learning_parity import make_config, random_model_folder, train  # noqa: E402

from engine.data.synthetic import write_text_jsonl  # noqa: E402

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
# Left allocated after a run, beyond the first run's: one layer input of this shape is 4 MiB.
SLACK = 2 * 2**20


def _allocated_after_release() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _live_blocks() -> dict[int, dict]:
    """Allocated blocks by address, each with the frames that allocated it (memory history on)."""
    blocks = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[block["address"]] = block
    return blocks


def _where(block: dict) -> str:
    """The block's size and the innermost frames of this repository (or torch's, if none)."""
    frames = block.get("frames") or []
    ours = [f for f in frames if "/engine/" in f["filename"] or "/tests/" in f["filename"]]
    shown = (ours or frames)[:3]
    return f"{block['size'] / 2**20:.1f} MiB at " + " < ".join(
        f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in shown
    )


def _blocks_one_more_run_leaves(cfg) -> list[str]:
    """The blocks one more run leaves allocated, each with the frames that allocated it: taken only once
    the test has failed, because recording Python stacks can itself break a run (on the H100, torch
    2.11: a SystemError inside torch.utils.checkpoint's recompute of an autograd Function)."""
    held = set(_live_blocks())
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    try:
        train(cfg)
        _allocated_after_release()
        new = [b for a, b in _live_blocks().items() if a not in held]
    except Exception as exc:  # the history's own failure: the sizes are still worth naming
        return [f"(no allocation history: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})"]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [_where(b) for b in sorted(new, key=lambda b: -b["size"])[:8]]


@pytest.mark.parametrize("offload", ["off", "double"])
def test_runs_in_one_process_leave_no_device_memory_behind(tmp_path, offload):
    folder = random_model_folder(tmp_path / "qwen3-small", "qwen3", **SHAPE)
    data = write_text_jsonl(tmp_path / "docs.jsonl", 600, seed=5)
    # CUDA graphs (auto: on for SFT below hidden 4,096 on a big card), packed rows, gradient
    # checkpointing with the offloader as W1 runs it.
    cfg = make_config(
        str(folder), data, tmp_path / "runs", steps=4, seq=2048, rows=1, gradient_checkpointing=True, offload=offload
    )
    before = _allocated_after_release()
    left = []
    for _ in range(3):
        curve = train(cfg)
        assert len(curve.losses) == 4
        del curve
        left.append(_allocated_after_release() - before)
    grown = [b - left[0] for b in left[1:]]
    if all(g <= SLACK for g in grown):
        return
    raise AssertionError(
        f"device memory left after each run (MiB): {[round(x / 2**20, 1) for x in left]}; "
        f"growth after the first: {[round(g / 2**20, 1) for g in grown]}; blocks one more run left allocated: "
        f"{_blocks_one_more_run_leaves(cfg)}"
    )
