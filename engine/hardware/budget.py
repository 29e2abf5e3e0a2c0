"""What the defaults policy's decisions share: the memory `Budget` a run plans against once its
device is settled (`memory_budget`: measured free memory less the kind's margin), the `Sizer`
that estimates a candidate setting's peak, and the `Decision` type (a value and its reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.hardware.kinds import CPU_PLAN_FRACTION, KIND_RULES, KindRules
from engine.hardware.profile import GiB, HardwareProfile, MiB
from engine.models import estimate as est

# Used to size the cross-entropy chunk when the model is not known yet: a large modern
# vocabulary (Qwen), so the chunk is never too big for the model that does get loaded.
DEFAULT_VOCAB = 151_936


# Below this fraction of the budget, skipping checkpointing buys speed safely.
NO_CHECKPOINT_FRACTION = 0.5


# Fused cross-entropy chunk: chunk_tokens * vocab * 4 bytes stays under this share of the
# budget, and under an absolute cap (larger chunks stop getting faster).
CE_BUDGET_FRACTION = 0.04


CE_BUDGET_CAP = 1 * GiB


# Double-buffered offload needs one more layer's activations on the device (<= 0.5 GiB in the
# reference workloads); this is what it costs when the model is not known.
DOUBLE_BUFFER_EXTRA_UNKNOWN = 512 * MiB


# A micro-batch this large keeps a GPU's matmuls busy. On a consumer card a model whose 16-bit
# weights leave no room for one is trained in 4 bits (that is the size threshold: it moves with
# the card), and a datacenter step that fits one without offload skips the offload copies.
BUSY_TOKENS = 8_192


# Checkpointing is skipped when a micro-batch of this many tokens (or the kind's ceiling, if
# smaller) fits without it in half the budget; the rows then grow without it while they fit.
NO_CHECKPOINT_PROBE_TOKENS = 16_384


# Others' use of a consumer card above this share is worth a word (a game, a second run).
BUSY_CARD_FRACTION = 0.25


# A decided value and the reason for it, as shown to the user.
Decision = tuple[Any, str]


@dataclass(frozen=True)
class Budget:
    """The memory a run plans against, once its device is settled."""

    on_gpu: bool
    memory: int  # bytes the run plans to fill: free memory less the kind's margin
    total: int  # bytes of the device (VRAM, unified memory or available RAM)
    free: int  # bytes free there now
    where: str  # "VRAM", "unified memory" or "RAM", for the reasons
    kind: str  # the KIND_RULES row that applies ("cpu" for a CPU run on any machine)

    @property
    def rules(self) -> KindRules:
        return KIND_RULES[self.kind]

    def __str__(self) -> str:
        return f"{_gib(self.memory)} {self.where} budget"


def memory_budget(device: str, profile: HardwareProfile) -> Decision:
    """The bytes a run may fill (a `Budget`) and why: measured free memory less what the kind
    leaves to others. Unified memory budgets against the OS's available figure, which counts the
    page cache it can reclaim (cudaMemGetInfo under-reports there)."""
    on_gpu = device == "cuda" and profile.has_gpu
    if not on_gpu:
        rules = KIND_RULES["cpu"]
        memory = int(CPU_PLAN_FRACTION * profile.ram_available)
        budget = Budget(False, memory, profile.ram_available, profile.ram_available, "RAM", "cpu")
        return budget, (
            f"{CPU_PLAN_FRACTION:.0%} of the {_gib(profile.ram_available)} of RAM available, "
            f"the rest left to {rules.margin_for}"
        )
    kind = profile.kind if profile.kind in KIND_RULES else "rtx_desktop"
    if profile.integrated_memory:
        kind = "dgx_spark"  # whatever the name says, shared memory is budgeted as shared
    rules = KIND_RULES[kind]
    margin = max(rules.margin_min, int(rules.margin_fraction * profile.total_vram))
    if profile.integrated_memory:
        free = min(profile.total_vram, profile.ram_available)
        measured = f"the OS reports {_gib(free)} available of {_gib(profile.total_vram)} unified memory"
        where = "unified memory"
    else:
        free = min(profile.total_vram, profile.free_vram)
        measured = f"{_gib(free)} of {_gib(profile.total_vram)} VRAM measured free"
        where = "VRAM"
    memory = max(0, free - margin)
    budget = Budget(True, memory, profile.total_vram, free, where, kind)
    return budget, f"{rules.label}: {measured}, less {_gib(margin)} left to {rules.margin_for}"


def budget_for(device: str, profile: HardwareProfile) -> Budget:
    return memory_budget(device, profile)[0]


@dataclass(frozen=True)
class Sizer:
    """The run's estimated peak memory for candidate settings (engine.models.estimate); only
    called when the model's shapes are known."""

    info: est.ModelInfo | None
    seq: int
    r: int
    ce_chunk_tokens: int
    shards: int = 1  # FSDP across this many processes: each device holds 1/shards of the base
    # Offload's recompute will be lean (fast_path_choices.lean_recompute_planned): an offloaded
    # step's estimate counts the MLP backward's row tiles instead of the whole gate and up.
    lean_recompute: bool = False

    def __call__(self, mode: str, tokens: int, ckpt: bool, offload: str) -> int:
        parts = est.estimate_breakdown(
            self.info,
            self.seq,
            self.r,
            mode,
            tokens,
            ckpt,
            offload=offload,
            ce_chunk_tokens=self.ce_chunk_tokens,
            lean_recompute=self.lean_recompute,
        )
        if self.shards <= 1:
            return parts.total
        # FSDP2: a device keeps its shard of the base and, while a layer runs, that layer
        # gathered whole, with the next one prefetched (two layers of 16-bit weights).
        layer = parts.weights / max(1, self.info.num_layers)
        return parts.total - parts.weights + int(parts.weights / self.shards + 2 * layer)


def documents_alone(info: est.ModelInfo | None) -> str | None:
    """Why each document of a packed row runs as its own forward for the model (its layers carry
    state along a row, Arch.row_state: LFM2, Jamba, Qwen3.5, ...; or its family is not one checked
    to keep packed documents apart, engine.models.arch.packing), or None. For those activation
    offload does not run (engine.train.step) and FSDP cannot train them (engine.train.fsdp). None
    for a model not known yet."""
    if info is None:
        return None
    from engine.models.arch.packing import documents_alone as why_alone

    return why_alone(getattr(info, "model_type", None))


def training_mode(load_in_4bit: Any, dtype: str) -> str:
    """The estimate's name for how the base weights are held."""
    return "qlora4" if load_in_4bit is True else "lora32" if dtype == "float32" else "lora16"


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


def _cap(profile: HardwareProfile) -> str:
    c = profile.compute_capability
    return f"{c[0]}.{c[1]}" if c else "n/a"
