"""`--memory-peak`: what is alive on the device at a step's peak, by the source line that allocated it.

After the timed steps, one more step runs with the CUDA caching allocator's history on
(torch.cuda.memory._record_memory_history, Python stacks). Replaying that history gives the
allocated bytes after every event; at the highest point the live blocks are grouped by the
innermost frame in this project's code (engine/, bench/) or, where there is none, the innermost
Python frame (an autograd-engine allocation in a C++ backward has no Python frame at all).
Memory allocated before the step (weights, optimizer state, buffers kept across steps) is one
line, "held before the step".

The record gets ``memory_peak``: the step's peak in GiB, what allocated the block that set it,
and the top lines in MiB. A memory target missed by tens of MiB is then a question of which of
these lines to shrink, not a guess.
"""

from __future__ import annotations

from contextlib import contextmanager

from bench.report import progress

MIB = 1 << 20
# Frames from these parts of a path are this project's code: the first one names an allocation.
OWN = ("/engine/", "/bench/")


def _where(frames: list[dict]) -> str:
    """The innermost frame in this project's code, else the innermost Python frame."""
    if not frames:
        return "(no Python frame: autograd engine / C++)"
    for f in frames:
        name = f.get("filename", "")
        if any(part in name for part in OWN) and "/bench/memory_peak.py" not in name:
            short = name[name.rfind("/engine/") + 1 :] if "/engine/" in name else name[name.rfind("/bench/") + 1 :]
            return f"{short}:{f.get('line')} {f.get('name')}"
    f = frames[0]
    return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"


def peak_breakdown(trace: list[dict], held_before: int, top: int = 15) -> dict:
    """Replay one device's allocator trace; the live blocks at its highest point, grouped."""
    live: dict[int, tuple[int, str]] = {}
    total = held_before
    best, best_live, best_event = total, {}, None
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            where = _where(ev.get("frames") or [])
            live[ev["addr"]] = (ev["size"], where)
            total += ev["size"]
            if total > best:
                best, best_live, best_event = total, dict(live), where
        elif action == "free_completed":
            blk = live.pop(ev["addr"], None)
            # A block allocated before the recording began: it was counted in held_before.
            total -= blk[0] if blk else ev["size"]
    groups: dict[str, int] = {}
    for size, where in best_live.values():
        groups[where] = groups.get(where, 0) + size
    lines = sorted(groups.items(), key=lambda kv: -kv[1])
    rows = [["held before the step", round(held_before / MIB, 1)]]
    rows += [[w, round(s / MIB, 1)] for w, s in lines[:top]]
    rest = sum(s for _, s in lines[top:])
    if rest:
        rows.append([f"{len(lines) - top} more lines", round(rest / MIB, 1)])
    return {"peak_gib": round(best / (1 << 30), 3), "set_by": best_event, "lines_mib": rows}


@contextmanager
def recorded_peak(label: str, out: dict):
    """Record the allocator's history over the block; on leaving it (also by an exception, such as
    an out-of-memory error: then the breakdown is of the highest point before the failure), fill
    `out` with the peak's breakdown and print it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        yield
    finally:
        try:
            torch.cuda.synchronize()
        except RuntimeError:  # an error the block left on the device must not hide the breakdown
            pass
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        dev = torch.cuda.current_device()
        traces = snap.get("device_traces") or []
        out.update(peak_breakdown(traces[dev] if dev < len(traces) else [], held))
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 3)
        table = "\n".join(f"  {mib:>10,.1f} MiB  {where}" for where, mib in out["lines_mib"])
        progress(
            f"{label} memory at the step's peak: {out['peak_gib']} GiB from the trace "
            f"(max_memory_allocated {out['max_memory_allocated_gib']} GiB), set by {out['set_by']}\n{table}"
        )


def memory_peak_step(prep, ctx, label: str) -> dict:
    """Run one step with the allocator's history on and return its peak's breakdown."""
    if ctx.device.type != "cuda":
        return {}
    import torch

    n = len(ctx.batches)
    out: dict = {}
    with recorded_peak(label, out):
        prep.step((ctx.warmup + ctx.steps) % n)
        torch.cuda.synchronize()
    return {"memory_peak": out}
