"""The learning-parity check shared by the CPU tier (tests/engine/train/test_learning.py) and the GPU
tier (tests/gpu/test_learning_gpu.py).

A fast path is done when it learns like the stock path over many optimizer steps, not when one
step's gradients match: a fast path whose cached adapter weights went stale after the first
step passed every one-step check and learned nothing. So each check here trains the same
model on the same learnable data (engine.data.synthetic) through the real TrainingSession
twice, once with the fast path under test and once on the stock HF + PEFT path (every fast
path off, the unfused optimizer), and compares the per-step loss curves and the adapters.
"""

from __future__ import annotations

import copy
import itertools
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import FastPathConfig, RunConfig
from engine.data.synthetic import write_text_jsonl
from engine.events import Failed, StepMetrics
from engine.resources import DEMO_MODEL_DIR
from engine.train.session import TrainingSession

# Every fast path off and the stock optimizer: what plain transformers + PEFT would run.
STOCK_FAST_PATHS = dict(
    kernels=False,
    lora_autograd=False,
    fused_ce=False,
    packed_attention=False,
    cached_metadata=False,
    moe_grouping=False,
    keep_attention=False,
    cuda_graphs=False,
)
STOCK_TRAINING = dict(optimizer="adamw", offload="off")


_RUN_NUMBERS = itertools.count(1)


@dataclass
class Curve:
    """What one training run left behind."""

    losses: list[float]
    adapter: dict[str, torch.Tensor]
    steps: list[StepMetrics] = field(default_factory=list)
    run_dir: Path | None = None
    fast_report: dict = field(default_factory=dict)

    @property
    def fall(self) -> float:
        """First step's loss minus the mean of the last three (nats)."""
        return self.losses[0] - sum(self.losses[-3:]) / 3


def learnable_jsonl(folder: Path, docs: int = 400, seed: int = 0) -> Path:
    return write_text_jsonl(Path(folder) / "learnable.jsonl", docs, seed)


def random_model_folder(folder: Path, model_type: str, **shape) -> Path:
    """A local Hugging Face folder (kept if already there): random bf16 weights of a config's
    shape, the demo tokenizer's 1,024-token vocabulary, and that tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    cfg = AutoConfig.for_model(model_type, vocab_size=1024, bos_token_id=None, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # some modules leave weights empty or zero at init
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_MODEL_DIR / name).exists():
            shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


def make_config(
    model: str,
    data: Path,
    out: Path,
    *,
    steps: int = 30,
    seq: int = 256,
    rows: int = 1,
    lr: float = 1e-3,
    fast: dict | None = None,
    **training,
) -> RunConfig:
    """A run of `steps` optimizer steps on plain-text `data`, constant LR, no dropout."""
    cfg = RunConfig()
    cfg.model.name_or_path = model
    cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout = 16, 16.0, 0.0
    cfg.data.source, cfg.data.format = str(data), "text"
    cfg.data.max_seq_len = seq
    t = cfg.training
    t.max_steps, t.rows_per_micro_batch, t.grad_accum = steps, rows, 1
    t.lr, t.scheduler, t.warmup_steps, t.max_grad_norm, t.seed = lr, "constant", 0, 1.0, 7
    t.save_every, t.log_every = 0, 1
    for k, v in training.items():
        setattr(t, k, v)
    for k, v in (fast or {}).items():
        setattr(cfg.fast_paths, k, v)
    cfg.output.dir, cfg.output.run_name = str(out), "run"
    return cfg


def stock(cfg: RunConfig) -> RunConfig:
    """The same run on the stock HF + PEFT path."""
    ref = copy.deepcopy(cfg)
    ref.fast_paths = FastPathConfig(**{**ref.fast_paths.__dict__, **STOCK_FAST_PATHS})
    for k, v in STOCK_TRAINING.items():
        setattr(ref.training, k, v)
    return ref


def train(cfg: RunConfig, out: Path | None = None, resume_from=None, stop_after: int | None = None) -> Curve:
    """Run a TrainingSession to the end (or request a stop after `stop_after` steps)."""
    cfg = copy.deepcopy(cfg)
    if out is not None:
        cfg.output.dir = str(out)
    cfg.output.run_name = f"run-{next(_RUN_NUMBERS)}"  # every run its own folder
    events = []
    session: TrainingSession

    def on_event(e):
        events.append(e)
        if stop_after is not None and isinstance(e, StepMetrics) and e.step >= stop_after:
            session.request_stop()

    session = TrainingSession(cfg, on_event, resume_from=resume_from)
    result = session.run()
    if isinstance(result, Failed):
        raise AssertionError(f"training failed: {result.message}\n{result.detail}")
    steps = [e for e in events if isinstance(e, StepMetrics)]
    started = [e for e in events if type(e).__name__ == "RunStarted"]
    adapter = {}
    model = getattr(session, "model", None)
    if model is not None:
        adapter = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Curve([s.loss for s in steps], adapter, steps, session.run_dir, started[0].fast_paths if started else {})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: one number per tensor, well conditioned unlike per-element checks."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(
    ours: Curve,
    ref: Curve,
    *,
    step_rel: float,
    final_rel: float,
    min_fall: float,
    fall_rel: float = 0.10,
    adapter_rel: float | None = None,
) -> list[str]:
    """Reasons `ours` does not learn like `ref` (empty: it does)."""
    problems = []
    if len(ours.losses) != len(ref.losses):
        return [f"{len(ours.losses)} steps against the reference's {len(ref.losses)}"]
    if not all(math.isfinite(x) for x in ours.losses):
        problems.append(f"non-finite loss: {ours.losses}")
    if ref.fall < min_fall:
        problems.append(
            f"the reference fell only {ref.fall:.3f} nats (< {min_fall}); the data or LR "
            "cannot tell a learning run from a flat one"
        )
    if abs(ours.fall - ref.fall) > fall_rel * abs(ref.fall):
        problems.append(f"fell {ours.fall:.4f} nats, the reference {ref.fall:.4f} (more than {fall_rel:.0%} apart)")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, ref.losses))
    if worst > step_rel:
        i = max(range(len(ref.losses)), key=lambda i: abs(ours.losses[i] - ref.losses[i]) / abs(ref.losses[i]))
        problems.append(
            f"step {i + 1}: loss {ours.losses[i]:.6f} vs {ref.losses[i]:.6f} (relative {worst:.2e} > {step_rel:.0e})"
        )
    fin = abs(ours.losses[-1] - ref.losses[-1]) / abs(ref.losses[-1])
    if fin > final_rel:
        problems.append(f"final loss {ours.losses[-1]:.6f} vs {ref.losses[-1]:.6f} (relative {fin:.2e})")
    if adapter_rel is not None:
        assert ours.adapter.keys() == ref.adapter.keys()
        # B starts at zero, so after N steps every adapter tensor is well away from zero and a
        # norm-relative error is meaningful for each.
        errs = {k: rel_err(ours.adapter[k], ref.adapter[k]) for k in ref.adapter}
        bad = {k: v for k, v in errs.items() if v > adapter_rel}
        if bad:
            k = max(bad, key=bad.get)
            problems.append(
                f"{len(bad)} adapter tensors differ by more than {adapter_rel:.0e} (worst {k}: {bad[k]:.2e})"
            )
    return problems


def curve_table(named: dict[str, Curve]) -> str:
    """The curves side by side, for a failure message or the GPU log."""
    names = list(named)
    n = max(len(c.losses) for c in named.values())
    rows = ["step " + " ".join(f"{k:>14}" for k in names)]
    for i in range(n):
        rows.append(
            f"{i + 1:>4} "
            + " ".join(f"{named[k].losses[i]:>14.6f}" if i < len(named[k].losses) else " " * 14 for k in names)
        )
    return "\n".join(rows)
