"""What each kind of machine plans for (the defaults policy's KIND_RULES, one row per kind):
how much memory it leaves to others, how large an automatic micro-batch may grow, whether a
model that crowds the card goes to 4 bits, and when activations are offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.hardware.profile import GiB, MiB
from engine.models import estimate as est

# CPU runs plan against this fraction of the available RAM (the OS and the window need the rest).
CPU_PLAN_FRACTION = est.FIT_FRACTION


@dataclass(frozen=True)
class KindRules:
    """How one kind of machine turns its memory into defaults."""

    label: str  # for the reasons
    margin_fraction: float  # of the device's memory left to others, at least margin_min
    margin_min: int
    margin_for: str  # who the margin is left for
    max_tokens: int  # ceiling of an automatic micro-batch
    tokens_why: str
    prefer_4bit: bool  # 4 bits when 16 bits leave no room for a BUSY_TOKENS micro-batch
    offload: str  # "on": whenever checkpointing; "when_needed": only if the step does not fit; "never"


KIND_RULES: dict[str, KindRules] = {
    "rtx_laptop": KindRules(
        label="RTX laptop",
        margin_fraction=0.10,
        margin_min=768 * MiB,
        margin_for="the desktop and browser, which draw from the same card and grow during a run",
        max_tokens=32_768,
        tokens_why="conservative on a laptop: steps stay a few seconds long, so pause and stop answer quickly",
        prefer_4bit=True,
        offload="on",
    ),
    "rtx_desktop": KindRules(
        label="RTX desktop",
        margin_fraction=0.05,
        margin_min=384 * MiB,
        margin_for="a display and other programs that may use this card",
        max_tokens=32_768,
        tokens_why="as on a laptop: steps stay a few seconds long, so pause and stop answer quickly",
        prefer_4bit=True,
        offload="on",
    ),
    "datacenter": KindRules(
        label="datacenter GPU",
        margin_fraction=0.02,
        margin_min=256 * MiB,
        margin_for="other processes on the card (it drives no display)",
        max_tokens=65_536,
        tokens_why="a datacenter GPU needs large micro-batches to stay busy",
        prefer_4bit=False,
        offload="when_needed",
    ),
    "dgx_spark": KindRules(
        label="unified memory",
        margin_fraction=0.05,
        margin_min=4 * GiB,
        margin_for="the OS and the programs that share unified memory with the GPU",
        max_tokens=32_768,
        tokens_why="enough to keep a GB10-class GPU busy; its memory is plentiful but slower than VRAM",
        prefer_4bit=False,
        offload="never",
    ),
    "cpu": KindRules(
        label="CPU",
        margin_fraction=1 - CPU_PLAN_FRACTION,
        margin_min=0,
        margin_for="the OS and the window",
        max_tokens=0,  # CPU micro-batches follow micro_batch_target, not a ceiling
        tokens_why="CPU: small micro-batches keep steps short",
        prefer_4bit=False,
        offload="never",
    ),
}
