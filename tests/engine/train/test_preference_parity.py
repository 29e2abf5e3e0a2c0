"""DPO, ORPO, SimPO and KTO learn like TRL's trainers (DPOTrainer, ORPOTrainer, CPOTrainer with
loss_type="simpo", KTOTrainer): the same tiny model built from a config, the same LoRA, data,
order, optimizer and seed, fp32 on the CPU. TRL trains one copy; the other is trained here
through the engine's path (packed sequences, the fast LoRA path, per-token log-probs through
the fused head, the losses of engine.train.objectives, the reference pass with the adapters
off on the same weights). Per-step loss and reward margins must match over several steps.

The reference must be the adapter-free base: the same loop with the reference computed with
the adapters on must fail the comparison (at step 0 the fresh adapter is zero, so the runs part
from the second step on).

Both sides live in tests/preference_parity.py (trl_run, our_run); the GPU tier runs the same
code for 30 steps on CUDA (tests/gpu/test_preference_parity_gpu.py).
"""

from __future__ import annotations

import copy

import pytest

from tests.preference_parity import Setting, matches, our_run, trl_run

CPU = Setting(device="cpu", steps=6)  # 6 steps of 2 pairs: round the 8 rows once and a half, in order


def _matches(ours: dict, theirs: dict) -> bool:
    """fp32 on one CPU: per-step loss within 1e-4, margins within 1e-3 of the largest margin."""
    return matches(ours, theirs, loss_rtol=1e-4, margin_rtol=1e-3)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    theirs, data, ours, _ = trl_run("dpo", CPU, tmp_path_factory.mktemp("dpo"))
    return theirs, data, ours


def test_dpo_matches_trl_dpo_trainer(dpo_run):
    theirs, data, ours = dpo_run
    run = our_run("dpo", CPU, copy.deepcopy(ours), data)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.05  # the runs did learn a preference


def test_dpo_with_the_reference_computed_with_adapters_on_does_not_match(dpo_run):
    theirs, data, ours = dpo_run
    run = our_run("dpo", CPU, copy.deepcopy(ours), data, adapters_on=True)
    assert not _matches(run, theirs)
    assert run["margins"][1:] == [0.0] * (CPU.steps - 1)  # the policy is its own reference: no margin, ever


# ORPO's and CPO's trainers tokenize prompt and answers into chosen/rejected ids and labels.


def test_orpo_matches_trl_orpo_trainer(tmp_path):
    theirs, data, ours, _ = trl_run("orpo", CPU, tmp_path)
    run = our_run("orpo", CPU, ours, data)
    assert _matches(run, theirs), (run, theirs)


def test_simpo_matches_trl_cpo_trainer(tmp_path):
    theirs, data, ours, _ = trl_run("simpo", CPU, tmp_path)
    run = our_run("simpo", CPU, ours, data)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.05


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory):
    theirs, data, ours, _ = trl_run("kto", CPU, tmp_path_factory.mktemp("kto"))
    return theirs, data, ours


def test_kto_matches_trl_kto_trainer(kto_run):
    theirs, data, ours = kto_run
    run = our_run("kto", CPU, copy.deepcopy(ours), data)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.02


def test_kto_with_the_reference_computed_with_adapters_on_does_not_match(kto_run):
    theirs, data, ours = kto_run
    assert not _matches(our_run("kto", CPU, copy.deepcopy(ours), data, adapters_on=True), theirs)
