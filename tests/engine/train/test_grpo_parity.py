"""GRPO's loss and LoRA gradients equal TRL GRPOTrainer's for fixed completions and rewards (fp32,
CPU): the same tiny model and adapter, prompts, completions, rewards, old log-probs (shifted so
the ratio clips) and sampling temperature. TRL's side is its own `_compute_loss` on its padded
batch, with the reference log-probs from its own scorer over the base (adapters off); ours is the
engine's packed path: one packed row of every (prompt, completion), per-token log-probs through
the fused head, the reference pass with the adapters off on the fast path, engine.train
.objectives.grpo_loss. The comparison must fail when our reference is computed with the
adapters on."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from engine.train.objectives.grpo_loss import batch_loss, group_advantages
from engine.train.objectives.logps import SequenceBatch, token_logps
from tests.preference_parity import prepare, tokenizer, trl_args, twins

GROUP = 4
TEMPERATURE = 0.7
BETA = 0.05
PROMPTS = ["What is 7 plus 5?", "Name the capital city of Greece."]
COMPLETIONS = [
    ["Answer: 12", "Answer: 13", "12", "Answer: twelve and more"],
    ["Answer: Athens", "Athens", "Answer: Rome", "I think it is Athens"],
]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.5, 0.0, 0.25]


def _ids(tok):
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    comps = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for cs in COMPLETIONS for c in cs]
    return prompts, comps


def _perturb(model, seed):
    """Non-zero LoRA B, so that the policy differs from the base (the KL term and the check that
    the reference is adapter-free depend on it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _trl_inputs(prompts, comps, pad):
    """TRL's layout: prompts left-padded, completions right-padded, one row per completion."""
    rows_p = [prompts[i // GROUP] for i in range(len(comps))]
    lp, lc = max(map(len, rows_p)), max(map(len, comps))
    prompt_ids = torch.tensor([[pad] * (lp - len(p)) + p for p in rows_p])
    prompt_mask = torch.tensor([[0] * (lp - len(p)) + [1] * len(p) for p in rows_p])
    completion_ids = torch.tensor([c + [pad] * (lc - len(c)) for c in comps])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (lc - len(c)) for c in comps])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _to_packed(padded: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """[completions, Tc] (TRL's layout) -> [T] on the packed row, at each completion target."""
    out = torch.zeros(batch.num_tokens)
    start = 0
    for i, (n_p, n_c) in enumerate(zip(batch.prompt_tokens, batch.completion_tokens)):
        out[start + n_p - 1 : start + n_p - 1 + n_c] = padded[i, :n_c]
        start += batch.info.lengths[i]
    return out


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None and "default" in n}


def test_group_advantages_are_trls():
    from trl.trainer.utils import nanstd

    r = torch.tensor(REWARDS)
    grouped = r.view(-1, GROUP)
    want = (r - grouped.mean(1).repeat_interleave(GROUP)) / (nanstd(grouped, dim=1).repeat_interleave(GROUP) + 1e-4)
    torch.testing.assert_close(group_advantages(r, GROUP), want)
    batch_scaled = (r - grouped.mean(1).repeat_interleave(GROUP)) / (nanstd(r) + 1e-4)
    torch.testing.assert_close(group_advantages(r, GROUP, "batch"), batch_scaled)
    torch.testing.assert_close(group_advantages(r, GROUP, "none"), r - grouped.mean(1).repeat_interleave(GROUP))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


@pytest.fixture(scope="module")
def trl_side(tmp_path_factory):
    import copy

    from trl import GRPOConfig, GRPOTrainer

    theirs, ours = twins()
    _perturb(theirs, 1)
    _perturb(ours, 1)
    tok = tokenizer()
    prompts, comps = _ids(tok)
    results = {}
    for loss_type in ("grpo", "dapo"):
        args = trl_args(
            GRPOConfig,
            tmp_path_factory.mktemp(loss_type),
            1,
            len(comps),
            num_generations=GROUP,
            temperature=TEMPERATURE,
            beta=BETA,
            loss_type=loss_type,
            max_completion_length=16,
        )
        ds = Dataset.from_list([{"prompt": p} for p in PROMPTS])
        trainer = GRPOTrainer(
            model=copy.deepcopy(theirs),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=ds,
            processing_class=tok,
        )
        trainer.current_gradient_accumulation_steps = 1  # set by its training loop; one step here
        model = trainer.model
        p_ids, p_mask, c_ids, c_mask = _trl_inputs(prompts, comps, tok.pad_token_id)
        ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        with torch.no_grad():
            policy, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_ids.shape[1])
            with model.disable_adapter():
                ref, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, c_ids.shape[1])
        # An older sampling policy, so some ratios leave [1 - eps, 1 + eps] and are clipped.
        g = torch.Generator().manual_seed(3)
        old = policy + 0.3 * torch.randn(policy.shape, generator=g)
        inputs = dict(
            prompt_ids=p_ids,
            prompt_mask=p_mask,
            completion_ids=c_ids,
            completion_mask=c_mask,
            advantages=group_advantages(torch.tensor(REWARDS), GROUP),
            old_per_token_logps=old,
            ref_per_token_logps=ref,
            num_items_in_batch=c_mask.sum(),
        )
        model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        results[loss_type] = dict(loss=loss.item(), grads=_grads(model), old=old, ref=ref)
        model.zero_grad(set_to_none=True)
    return results, ours, prompts, comps


def _ours(model, prompts, comps, theirs, loss_type, adapters_on=False):
    forward = prepare(model)
    batch = SequenceBatch.from_sequences([(prompts[i // GROUP], c) for i, c in enumerate(comps)])
    scale = 1 / TEMPERATURE
    if adapters_on:
        with torch.no_grad():
            ref = token_logps(forward, model, batch, scale)
    else:
        with model.disable_adapter(), torch.no_grad():
            ref = token_logps(forward, model, batch, scale)
    model.zero_grad(set_to_none=True)
    logps = token_logps(forward, model, batch, scale)
    loss, metrics = batch_loss(
        logps,
        batch,
        group_advantages(torch.tensor(REWARDS), GROUP),
        old_logps=_to_packed(theirs["old"], batch),
        ref_logps=ref,
        beta=BETA,
        loss_type=loss_type,
    )
    loss.backward()
    return loss.item(), _grads(model), metrics, batch, ref


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_loss_and_lora_gradients_equal_trls(trl_side, loss_type):
    import copy

    results, ours, prompts, comps = trl_side
    theirs = results[loss_type]
    loss, grads, metrics, batch, ref = _ours(copy.deepcopy(ours), prompts, comps, theirs, loss_type)
    # Our adapter-free reference on the fast path is TRL's base, token for token.
    torch.testing.assert_close(ref, _to_packed(theirs["ref"], batch), rtol=1e-5, atol=1e-5)
    assert metrics["clipped_tokens"] > 0 and metrics["kl_sum"] > 0  # both terms are exercised
    assert loss == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)
    assert grads.keys() == theirs["grads"].keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, theirs["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_grpo_with_the_reference_computed_with_adapters_on_does_not_match(trl_side):
    import copy

    results, ours, prompts, comps = trl_side
    theirs = results["grpo"]
    loss, grads, _, _, _ = _ours(copy.deepcopy(ours), prompts, comps, theirs, "grpo", adapters_on=True)
    assert loss != pytest.approx(theirs["loss"], rel=1e-4)
