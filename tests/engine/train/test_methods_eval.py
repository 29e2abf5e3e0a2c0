"""Held-out eval and the gallery for the preference methods, through the real TrainingSession
on the demo model: DPO, ORPO and SimPO report the held-out pairs' loss, reward margin and reward
accuracy (EvalMetrics), KTO its held-out loss and KL; the best checkpoint is the lowest held-out
loss; the gallery answers the held-out examples' prompts. A split of data.eval_fraction takes
whole examples out of the training data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.events import EvalMetrics, GalleryAnswers
from tests.engine.train.test_methods_session import config, demo_rows, write_pairs, write_unpaired


def held_pairs(tmp_path, n=12):
    """Pairs from demo rows the training file does not hold (write_pairs reads the first 40); the
    rejected answer is the same refusal for each (never equal to the chosen one)."""
    rows = demo_rows(40 + n)[40:]
    path = tmp_path / "held.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            f.write(json.dumps({"prompt": prompt, "chosen": r["output"], "rejected": "Answer: I do not know"}) + "\n")
    return path, rows


def session_with_eval(tmp_path, method, source, eval_source):
    cfg = config(tmp_path, method, source, steps=4)
    cfg.data.eval_source = str(eval_source)
    cfg.training.eval_every = 2
    cfg.training.gallery_size = 2
    events = []
    from engine.events import Failed
    from engine.train.session import TrainingSession

    result = TrainingSession(cfg, events.append).run()
    assert not isinstance(result, Failed), result.message + "\n" + result.detail
    return result, events


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo"])
def test_pair_methods_evaluate_held_out_pairs(tmp_path, method):
    eval_source, rows = held_pairs(tmp_path)
    result, events = session_with_eval(tmp_path, method, write_pairs(tmp_path / "pairs.jsonl"), eval_source)
    evals = [e for e in events if isinstance(e, EvalMetrics)]
    assert [e.step for e in evals] == [2, 4]
    for e in evals:
        assert e.examples == len(rows) and math.isfinite(e.eval_loss) and e.eval_loss > 0
        assert {"rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"} <= e.metrics.keys()
        assert 0 <= e.metrics["rewards/accuracies"] <= 1
    if method == "dpo":
        # The reference is the base with the adapters off: after training the policy differs, so
        # the margins are not 0 and the loss is not log 2 (they would be with the adapters on).
        assert all(abs(e.metrics["rewards/margins"]) > 1e-4 for e in evals), [e.metrics for e in evals]
        assert all(abs(e.eval_loss - math.log(2)) > 1e-5 for e in evals)
    best = min(evals, key=lambda e: e.eval_loss)
    assert evals[-1].best_step == best.step and evals[-1].best_loss == pytest.approx(best.eval_loss)
    assert json.loads((Path(result.run_dir) / "best.json").read_text())["step"] == best.step
    gallery = [e for e in events if isinstance(e, GalleryAnswers)]
    assert gallery and len(gallery[-1].prompts) == 2  # each the rendered prompt, as SFT's gallery shows it
    assert all(r["instruction"] in p for r, p in zip(rows, gallery[-1].prompts)), gallery[-1].prompts
    assert all(isinstance(a, str) for a in gallery[-1].answers)


def test_kto_evaluates_held_out_answers(tmp_path):
    pairs, rows = held_pairs(tmp_path)
    held = tmp_path / "held_kto.jsonl"
    with open(held, "w") as f:
        for line in pairs.read_text().splitlines():
            r = json.loads(line)
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["chosen"], "label": True}) + "\n")
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["rejected"], "label": False}) + "\n")
    _, events = session_with_eval(tmp_path, "kto", write_unpaired(tmp_path / "kto.jsonl"), held)
    evals = [e for e in events if isinstance(e, EvalMetrics)]
    assert [e.step for e in evals] == [2, 4]
    for e in evals:
        assert e.examples == 2 * len(rows) and math.isfinite(e.eval_loss) and e.eval_loss > 0
        assert {"kl", "rewards/chosen", "rewards/rejected"} <= e.metrics.keys()
    gallery = [e for e in events if isinstance(e, GalleryAnswers)]
    assert gallery and len(gallery[-1].prompts) == 2  # each prompt once (two answers share one)
    assert all(r["instruction"] in p for r, p in zip(rows, gallery[-1].prompts)), gallery[-1].prompts


def test_a_split_takes_whole_pairs_out_of_training(tmp_path):
    from engine.models.loading import load_tokenizer
    from engine.train.objectives import objective_for

    cfg = config(tmp_path, "dpo", write_pairs(tmp_path / "pairs.jsonl", n=400))
    cfg.data.eval_fraction = 0.05
    objective = objective_for(cfg)
    tok = load_tokenizer(cfg.model)
    data = objective.prepare_data(tok)
    train, held, note = objective.held_out(data, tok)
    n = len(data.examples)  # 400 rows, a few skipped (chosen equal to rejected)
    assert n > 380 and len(held) == round(0.05 * n) == 20 and len(train.examples) == n - 20
    assert "Held out 20 examples" in note
    assert not set(train.row_ids) & set(held.data.row_ids)  # the data rows: never trained on
    assert sorted(train.row_ids + held.data.row_ids) == sorted(data.row_ids)
    assert sorted(d for r in train.packing.rows for d in r) == list(range(n - 20))  # packed again
    cfg.data.eval_fraction = 0.0
    assert objective_for(cfg).held_out(data, tok)[1] is None


def test_grpo_evaluates_greedy_answers_to_held_out_prompts(tmp_path):
    from engine.config import RewardConfig
    from engine.events import Failed
    from engine.train.session import TrainingSession
    from tests.engine.train.test_methods_session import write_prompts

    held = tmp_path / "held_prompts.jsonl"
    rows = demo_rows(52)[40:]
    with open(held, "w") as f:
        for r in rows:
            prompt = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
            f.write(json.dumps({"prompt": prompt, "answer": r["output"].removeprefix("Answer: ")}) + "\n")
    cfg = config(tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl"), steps=4)
    cfg.data.eval_source = str(held)
    cfg.training.eval_every = 2
    cfg.training.gallery_size = 2
    cfg.grpo.group_size = 4
    cfg.grpo.max_new_tokens = 6
    # Every answer matches "(?s).*" (weight 0.5): the eval's reward is 0.5 + the exact-match mean.
    cfg.grpo.rewards = [
        RewardConfig(kind="regex", pattern=r"(?s).*", weight=0.5),
        RewardConfig(kind="exact", column="answer", pattern=r"Answer: (.+)"),
    ]
    events = []
    result = TrainingSession(cfg, events.append).run()
    assert not isinstance(result, Failed), result.message + "\n" + result.detail
    evals = [e for e in events if isinstance(e, EvalMetrics)]
    assert [e.step for e in evals] == [2, 4]
    for e in evals:
        m = e.metrics
        assert e.examples == len(rows) and e.tokens == len(rows)  # one greedy answer per prompt
        assert m["rewards/format/mean"] == 1.0 and m["rewards/format/std"] == 0.0
        assert m["reward"] == pytest.approx(0.5 + m["rewards/exact_answer/mean"])
        assert e.eval_loss == pytest.approx(-m["reward"])  # the best checkpoint: the highest reward
        assert 0 < m["completion_length"] <= 6 and "clip_ratio" not in m
    assert evals[-1].best_loss == pytest.approx(min(e.eval_loss for e in evals))
    gallery = [e for e in events if isinstance(e, GalleryAnswers)]
    assert gallery and all(r["instruction"] in p for r, p in zip(rows, gallery[-1].prompts))


def test_a_grpo_split_keeps_one_prompt_a_row(tmp_path):
    from engine.config import RewardConfig
    from engine.models.loading import load_tokenizer
    from engine.train.objectives import objective_for
    from tests.engine.train.test_methods_session import write_prompts

    cfg = config(tmp_path, "grpo", write_prompts(tmp_path / "prompts.jsonl", n=400))
    cfg.data.eval_fraction = 0.05
    cfg.grpo.rewards = [RewardConfig(kind="regex", pattern=r"Answer: (.+)")]
    objective = objective_for(cfg)
    tok = load_tokenizer(cfg.model)
    data = objective.prepare_data(tok)
    train, held, _ = objective.held_out(data, tok)
    assert len(held) == 20 and len(train.examples) == len(data.examples) - 20
    assert train.packing.rows == [[i] for i in range(len(train.examples))]
    assert len(train.rows) == len(train.examples) and not set(train.row_ids) & set(held.data.row_ids)
