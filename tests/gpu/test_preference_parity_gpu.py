"""DPO, ORPO, SimPO and KTO learn like TRL's trainers on the GPU: DPOTrainer, ORPOTrainer,
CPOTrainer (loss_type="simpo") and KTOTrainer against the engine's path, 30 steps on CUDA, on
the same tiny model, LoRA, data, order, optimizer and seed. The code is the CPU suite's
(tests/preference_parity.py: trl_run, our_run); here it runs longer and on the Triton kernels
(fused LoRA, packed attention, the fused per-token log-prob head).

fp32 on both sides (TF32 off, tests/gpu/conftest.py): the comparison is of the methods' math,
and bf16 rounding compounded over 30 AdamW steps would blur a 2% bound; TRL's bf16 is autocast
over fp32 weights, not the engine's bf16 weights, so the two would not even round alike. The
model is 2 layers of width 64: fp32 costs nothing on an H200.

Each method passes when, at every step, its loss is within 2% of TRL's and its reward margin
within 5% of the largest margin of TRL's run (a margin starts at 0: a per-step relative bound
means nothing there); when both curves fall by the same amount within 10% (the mean over the first pass
through the data against the mean over the last; TRL's by at least 0.04 nats: KTO's loss, bounded
by 1 and starting at 0.5, falls about 0.06 in 30 steps, DPO's about 0.2); and when the LoRA weights at the end
are within ADAPTER_RTOL of TRL's (relative Frobenius norm over all LoRA tensors together).
DPO and KTO also fail the comparison when the reference log-probs are computed with the
adapters on.

Run on the GPU host (about a minute):
    python -m pytest -m gpu tests/gpu/test_preference_parity_gpu.py -q
The same code on a CPU (the check of this file itself; several minutes on a busy CPU):
    TUNESMITH_PARITY_DEVICE=cpu python -m pytest -m gpu tests/gpu/test_preference_parity_gpu.py -q
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.preference_parity import METHODS, WITH_REFERENCE, Setting, lora_state, matches, our_run, trl_run

DEVICE = os.environ.get("TUNESMITH_PARITY_DEVICE", "cuda")
SETTING = Setting(device=DEVICE, steps=int(os.environ.get("TUNESMITH_PARITY_STEPS", "30")), dtype=torch.float32)
LOSS_RTOL, MARGIN_RTOL, FALL_RTOL, MIN_FALL = 0.02, 0.05, 0.10, 0.04
PASS = 4  # steps per pass through the data: 8 pairs 2 a step, or KTO's 16 rows 4 a step
ADAPTER_RTOL = 0.02

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_TRL: dict = {}


def _trl(method, tmp_path_factory):
    """TRL's run of `method` (once per session: the matching and the broken variant share it)."""
    if method not in _TRL:
        _TRL[method] = trl_run(method, SETTING, tmp_path_factory.mktemp(method))
    return _TRL[method]


def _fall(loss: list[float]) -> float:
    """Mean loss over the first pass through the data minus the mean over the last pass: the
    steps cycle through different rows, so single steps zigzag (KTO's by as much as it falls)."""
    return sum(loss[:PASS]) / PASS - sum(loss[-PASS:]) / PASS


def _adapter_error(ours, theirs) -> float:
    # The trained adapter is "default" on both sides (TRL's DPOTrainer adds a frozen "ref" copy).
    a, b = ({k: v for k, v in lora_state(m).items() if ".default." in k} for m in (ours, theirs))
    assert a.keys() == b.keys() and a, (sorted(a)[:3], sorted(b)[:3])
    diff = sum(((a[k].float().cpu() - b[k].float().cpu()) ** 2).sum() for k in a) ** 0.5
    return (diff / sum((b[k].float().cpu() ** 2).sum() for k in b) ** 0.5).item()


def _table(run, theirs) -> str:
    rows = [f"{'step':>4} {'TRL loss':>10} {'our loss':>10} {'TRL margin':>11} {'our margin':>11}"]
    for i, (a, b, c, d) in enumerate(zip(theirs["loss"], run["loss"], theirs["margins"], run["margins"])):
        rows.append(f"{i:>4} {a:>10.5f} {b:>10.5f} {c:>11.5f} {d:>11.5f}")
    return "\n".join(rows)


@pytest.mark.parametrize("method", METHODS)
def test_method_learns_like_its_trl_trainer(method, tmp_path_factory):
    from engine.counters import reset_counters, split_counts

    theirs, data, twin, trained = _trl(method, tmp_path_factory)
    ours = copy.deepcopy(twin)
    reset_counters()
    run = our_run(method, SETTING, ours, data)
    calls, fallbacks = split_counts(reset_counters())
    if DEVICE == "cuda":  # ours ran the GPU's path: the fused log-prob head, the reference pass fused too
        assert calls.get("token_logp:triton", 0) > 0, calls
        assert not any("adapters disabled" in k for k in fallbacks), fallbacks
    table = _table(run, theirs)
    assert len(theirs["loss"]) == SETTING.steps, table
    assert matches(run, theirs, LOSS_RTOL, MARGIN_RTOL), f"{method}: a step is off TRL's curve\n{table}"
    fall, their_fall = _fall(run["loss"]), _fall(theirs["loss"])
    assert their_fall >= MIN_FALL, f"{method}: TRL's loss fell {their_fall:.3f} nats only\n{table}"
    assert abs(fall - their_fall) <= FALL_RTOL * their_fall, f"{method}: fell {fall:.4f}, TRL {their_fall:.4f}"
    err = _adapter_error(ours, trained)
    print(
        f"\n{method} on {DEVICE}, {SETTING.steps} steps: LoRA weights' relative error {err:.2e}; ran {calls}\n{table}"
    )
    assert err <= ADAPTER_RTOL, f"{method}: LoRA weights {err:.3e} from TRL's at the end"


@pytest.mark.parametrize("method", WITH_REFERENCE)
def test_the_reference_with_adapters_on_does_not_match(method, tmp_path_factory):
    theirs, data, twin, _ = _trl(method, tmp_path_factory)
    run = our_run(method, SETTING, copy.deepcopy(twin), data, adapters_on=True)
    assert not matches(run, theirs, LOSS_RTOL, MARGIN_RTOL), _table(run, theirs)
