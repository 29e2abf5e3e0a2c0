"""The Hub's model card reads the run as engine.runs does (its history and config reader): the
last logged step of a resumed run, the finished session's summary, and a config.yaml that cannot
be read gives an "unknown" base rather than an error."""

from __future__ import annotations

import json

from engine.export import hub
from engine.runs import RunFolder


def _run(tmp_path, config: str) -> RunFolder:
    run = RunFolder(tmp_path / "r").create(fresh=True)
    run.config.write_text(config)
    events = [
        {"event": "RunStarted", "total_steps": 3},
        {"event": "StepMetrics", "step": 1, "loss": 3.0},
        {"event": "StepMetrics", "step": 2, "loss": 2.0},
        {"event": "Finished", "stopped": True, "summary": {"final_loss": 2.0, "steps": 2, "seconds": 9}},
        {"event": "RunStarted", "total_steps": 3},
        {"event": "StepMetrics", "step": 3, "loss": 1.5},
        {"event": "Finished", "stopped": False, "summary": {"final_loss": 1.5, "steps": 3, "best_eval_loss": 1.7}},
    ]
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in events) + "not json\n")
    return run


def test_the_card_has_the_last_step_and_the_last_sessions_summary(tmp_path):
    run = _run(tmp_path, "model:\n  name_or_path: org/base\ndata:\n  source: rows.jsonl\n")
    card = hub.model_card(run.path, "adapter")
    assert "from **org/base**" in card and "`rows.jsonl`" in card
    training = card.split("## Training\n", 1)[1].split("\n\n", 1)[0].splitlines()
    expected = ["- last_step: 3", "- last_loss: 1.5", "- final_loss: 1.5", "- steps: 3", "- best_eval_loss: 1.7"]
    assert training == expected


def test_an_unreadable_config_gives_an_unknown_base(tmp_path):
    run = _run(tmp_path, "model: [unclosed\n")
    card = hub.model_card(run.path, "adapter")
    assert "from **unknown**" in card and "- last_loss: 1.5" in card
