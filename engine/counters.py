"""Per-step counters of the engine's bookkeeping: packing-metadata builds, device-to-host syncs
and MoE block calls.

Counted where they happen (engine.packed, engine.attention, engine.moe); the training loop
reads and resets them once per optimizer step, so each StepMetrics event can show "metadata
built once, 0 syncs". Plain ints in one dict: counting must cost nothing on the hot path.
"""

from __future__ import annotations

COUNTERS = {"metadata_builds": 0, "host_syncs": 0, "moe_calls": 0}


def reset_counters() -> dict[str, int]:
    """Return the counts since the last reset and zero them."""
    snapshot = dict(COUNTERS)
    for k in COUNTERS:
        COUNTERS[k] = 0
    return snapshot
