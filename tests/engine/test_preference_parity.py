"""DPO, ORPO, SimPO and KTO learn like TRL's trainers (DPOTrainer, ORPOTrainer, CPOTrainer with
loss_type="simpo", KTOTrainer): the same tiny model built from a config, the same LoRA, data,
order, optimizer and seed, fp32 on the CPU. TRL trains one copy; the other is trained here
through the engine's path (packed sequences, the fast LoRA path, per-token log-probs through
the fused head, the losses of engine.train.objectives, the reference pass with the adapters
off on the same weights). Per-step loss and reward margins must match over several steps.

The reference must be the adapter-free base: the same loop with the reference computed with
the adapters on must fail the comparison (at step 0 the fresh adapter is zero, so the runs part
from the second step on).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from engine.kernels.token_logp import sum_per_document
from engine.train.objectives.dpo import dpo_loss
from engine.train.objectives.kto import kto_loss
from engine.train.objectives.logps import SequenceBatch, completion_means, completion_sums, token_logps
from engine.train.objectives.orpo import orpo_loss
from engine.train.objectives.simpo import simpo_loss
from tests.preference_parity import ROWS, logged, optimizer, prepare, tokenizer, trl_args, twins

STEPS = 6
PAIRS = 2  # pairs per step (8 rows: the run goes round the data set once and a half, in order)


def _matches(ours: dict, theirs: dict, loss_rtol=1e-4, margin_rtol=1e-3) -> bool:
    """Per-step loss within loss_rtol, margins within margin_rtol of the run's largest margin."""
    if len(ours["loss"]) != len(theirs["loss"]):
        return False
    scale = max(max(abs(m) for m in theirs["margins"]), 1e-6)
    for a, b in zip(ours["loss"], theirs["loss"]):
        if abs(a - b) > loss_rtol * max(abs(b), 1e-6):
            return False
    return all(abs(a - b) <= margin_rtol * scale for a, b in zip(ours["margins"], theirs["margins"]))


def _trl(trainer) -> dict:
    trainer.train()
    return {"loss": logged(trainer, "loss"), "margins": logged(trainer, "rewards/margins")}


def _rows(data, step, n):
    return [data[(step * n + i) % len(data)] for i in range(n)]


def _train(model, steps, loss_of) -> dict:
    """Our loop: loss_of(forward, step) -> (loss, metric sums); AdamW as TRL's Trainer sets it."""
    forward = prepare(model)
    opt = optimizer(model)
    out = {"loss": [], "margins": []}
    for step in range(steps):
        loss, metrics = loss_of(forward, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out["loss"].append(loss.item())
        out["margins"].append(metrics["rewards/margins"].item() / metrics["pairs"].item())
    return out


def _reference(forward, model, batch, adapters_on: bool):
    """The reference log-probs: the base with adapters off, or (the broken variant) the policy."""
    if adapters_on:
        with torch.no_grad():
            return token_logps(forward, model, batch)
    with model.disable_adapter(), torch.no_grad():
        return token_logps(forward, model, batch)


def _pair_rows(pairs):
    """Each pair's chosen and rejected completions side by side in one packed row."""
    seqs = []
    for prompt, chosen, rejected in pairs:
        seqs += [(prompt, chosen), (prompt, rejected)]
    return SequenceBatch.from_sequences(seqs)


# -- DPO -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    from trl import DPOConfig, DPOTrainer

    theirs, ours = twins()
    ds = Dataset.from_list([dict(prompt=p, chosen=c, rejected=r) for p, c, r in ROWS])
    args = trl_args(DPOConfig, tmp_path_factory.mktemp("dpo"), STEPS, PAIRS, beta=0.1)
    trainer = DPOTrainer(model=theirs, args=args, train_dataset=ds, processing_class=tokenizer())
    return _trl(trainer), trainer.train_dataset, ours


def _dpo(model, data, adapters_on=False):
    def loss_of(forward, step):
        rows = _rows(data, step, PAIRS)
        batch = _pair_rows([(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows])
        assert batch.info.lengths == [
            n
            for r in rows
            for n in (len(r["prompt_ids"]) + len(r["chosen_ids"]), len(r["prompt_ids"]) + len(r["rejected_ids"]))
        ]
        ref = completion_sums(_reference(forward, model, batch, adapters_on), batch)
        logps = completion_sums(token_logps(forward, model, batch), batch)
        return dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=0.1)

    return _train(model, STEPS, loss_of)


def test_dpo_matches_trl_dpo_trainer(dpo_run):
    import copy

    theirs, data, ours = dpo_run
    run = _dpo(copy.deepcopy(ours), data)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.05  # the runs did learn a preference


def test_dpo_with_the_reference_computed_with_adapters_on_does_not_match(dpo_run):
    import copy

    theirs, data, ours = dpo_run
    run = _dpo(copy.deepcopy(ours), data, adapters_on=True)
    assert not _matches(run, theirs)
    assert run["margins"][1:] == [0.0] * (STEPS - 1)  # the policy is its own reference: no margin, ever


# -- ORPO and SimPO (their trainers tokenize prompt and answers into chosen/rejected ids and labels) ---


def _split(ids, labels):
    p = next(i for i, lab in enumerate(labels) if lab != -100)
    return ids[:p], ids[p:]


def _paired(rows, score_prompt):
    seqs = []
    for r in rows:
        seqs += [
            _split(r["chosen_input_ids"], r["chosen_labels"]),
            _split(r["rejected_input_ids"], r["rejected_labels"]),
        ]
    return SequenceBatch.from_sequences(seqs, score_prompt=score_prompt)


def test_orpo_matches_trl_orpo_trainer(tmp_path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    theirs_m, ours_m = twins()
    ds = Dataset.from_list([dict(prompt=p, chosen=c, rejected=r) for p, c, r in ROWS])
    args = trl_args(ORPOConfig, tmp_path, STEPS, PAIRS, beta=0.1)
    trainer = ORPOTrainer(model=theirs_m, args=args, train_dataset=ds, processing_class=tokenizer())
    theirs = _trl(trainer)
    data = trainer.train_dataset

    def loss_of(forward, step):
        batch = _paired(_rows(data, step, PAIRS), score_prompt=True)
        logps = token_logps(forward, ours_m, batch)
        means = completion_means(logps, batch)
        whole = sum_per_document(logps, batch.info.lengths, batch.doc_index)  # prompt + answer
        chosen_targets = sum(n - 1 for n in batch.info.lengths[0::2])
        nll = -whole[0::2].sum() / chosen_targets
        return orpo_loss(means[0::2], means[1::2], nll, beta=0.1)

    run = _train(ours_m, STEPS, loss_of)
    assert _matches(run, theirs), (run, theirs)


def test_simpo_matches_trl_cpo_trainer(tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    theirs_m, ours_m = twins()
    ds = Dataset.from_list([dict(prompt=p, chosen=c, rejected=r) for p, c, r in ROWS])
    args = trl_args(CPOConfig, tmp_path, STEPS, PAIRS, beta=2.0, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5)
    trainer = CPOTrainer(model=theirs_m, args=args, train_dataset=ds, processing_class=tokenizer())
    theirs = _trl(trainer)
    data = trainer.train_dataset

    def loss_of(forward, step):
        batch = _paired(_rows(data, step, PAIRS), score_prompt=False)
        means = completion_means(token_logps(forward, ours_m, batch), batch)
        return simpo_loss(means[0::2], means[1::2], beta=2.0, gamma=0.5)

    run = _train(ours_m, STEPS, loss_of)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.05


# -- KTO -------------------------------------------------------------------------------------------

KTO_BATCH = 4


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory):
    from trl import KTOConfig, KTOTrainer

    theirs, ours = twins()
    rows = []
    for p, c, r in ROWS:
        rows += [dict(prompt=p, completion=c, label=True), dict(prompt=p, completion=r, label=False)]
    args = trl_args(KTOConfig, tmp_path_factory.mktemp("kto"), STEPS, KTO_BATCH, beta=0.1)
    trainer = KTOTrainer(model=theirs, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer())
    trainer.train()
    theirs_log = {k: logged(trainer, k) for k in ("loss", "rewards/chosen", "rewards/rejected", "kl")}
    theirs_log["margins"] = [c - r for c, r in zip(theirs_log["rewards/chosen"], theirs_log["rewards/rejected"])]
    return theirs_log, trainer.train_dataset, ours


def _kto(model, data, adapters_on=False):
    def loss_of(forward, step):
        rows = _rows(data, step, KTO_BATCH)
        batch = SequenceBatch.from_sequences([(r["prompt_ids"], r["completion_ids"]) for r in rows])
        # TRL's KL estimate: each prompt with the previous example's completion, no gradient.
        kl_batch = SequenceBatch.from_sequences([(r["prompt_ids"], r["KL_completion_ids"]) for r in rows])
        with torch.no_grad():
            kl = completion_sums(token_logps(forward, model, kl_batch), kl_batch)
        ref = completion_sums(_reference(forward, model, batch, adapters_on), batch)
        ref_kl = completion_sums(_reference(forward, model, kl_batch, adapters_on), kl_batch)
        logps = completion_sums(token_logps(forward, model, batch), batch)
        labels = torch.tensor([bool(r["label"]) for r in rows])
        loss, m = kto_loss(logps, ref, labels, kl, ref_kl, beta=0.1)
        chosen, rejected = m["chosen"].item(), m["rejected"].item()
        margin = m["rewards/chosen"] / chosen - m["rewards/rejected"] / rejected
        return loss, {"rewards/margins": margin, "pairs": torch.tensor(1.0)}

    return _train(model, STEPS, loss_of)


def test_kto_matches_trl_kto_trainer(kto_run):
    import copy

    theirs, data, ours = kto_run
    run = _kto(copy.deepcopy(ours), data)
    assert _matches(run, theirs), (run, theirs)
    assert max(abs(m) for m in theirs["margins"]) > 0.02


def test_kto_with_the_reference_computed_with_adapters_on_does_not_match(kto_run):
    import copy

    theirs, data, ours = kto_run
    assert not _matches(_kto(copy.deepcopy(ours), data, adapters_on=True), theirs)
