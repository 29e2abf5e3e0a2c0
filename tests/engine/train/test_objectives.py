"""The training objective as a part of its own (engine.train.objectives): the registry, and a
session that trains whatever objective `training.method` names through the objective's own
batch, normalizer, loss, step hook and metrics."""

import pytest

from engine.config import ConfigError, RunConfig
from engine.events import EvalMetrics, Failed, StepMetrics
from engine.resources import DEMO_HELDOUT_FILE, DEMO_PRESET
from engine.train.objectives import OBJECTIVES, known, objective_for
from engine.train.objectives.base import LossOutput
from engine.train.objectives.sft import SFT
from engine.train.session import TrainingSession


def config(tmp_path, name):
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.data.max_examples = 40
    cfg.data.max_seq_len = 128
    cfg.data.eval_source = str(DEMO_HELDOUT_FILE)
    cfg.training.max_steps = 3
    cfg.training.rows_per_micro_batch = 1
    cfg.training.grad_accum = 2
    cfg.training.eval_every = 3
    cfg.training.gallery_size = 0
    cfg.output.dir = str(tmp_path)
    cfg.output.run_name = name
    return cfg


def run(cfg):
    events = []
    result = TrainingSession(cfg, events.append).run()
    if isinstance(result, Failed):
        raise AssertionError(result.message + "\n" + result.detail)
    return events


def test_sft_is_the_default_and_an_unknown_method_names_the_field():
    cfg = RunConfig.load(DEMO_PRESET)
    assert cfg.training.method == "sft" and "sft" in known()
    assert isinstance(objective_for(cfg), SFT)
    cfg.training.method = "no-such-method"  # past the config's own check, as a registry miss
    with pytest.raises(ConfigError) as err:
        objective_for(cfg)
    assert err.value.path == "training.method" and "sft" in str(err.value)


class Counted(SFT):
    """SFT's loss, with a metric of its own (the batch's trained tokens) and a record of the
    hooks the session called: what a preference or RL method plugs into."""

    name = "test-counted"

    def __init__(self, config):
        super().__init__(config)
        self.steps, self.collated = [], 0

    def collate(self, data, example_ids):
        self.collated += 1
        return super().collate(data, example_ids)

    def prepare_step(self, ctx, micro):
        self.steps.append((ctx.step, ctx.rehearsal, len(micro)))
        return micro

    def loss(self, forward, model, batch, normalizer):
        import torch

        out = super().loss(forward, model, batch, normalizer)
        return LossOutput(out.loss, {"trained": torch.tensor(float(batch.num_trained_tokens))})

    def step_metrics(self, sums):
        return {"trained_tokens_seen": sums["trained"]}


def test_the_session_trains_the_objective_the_config_names(tmp_path, monkeypatch):
    made = []

    class Recorded(Counted):
        def __init__(self, config):
            super().__init__(config)
            made.append(self)

    monkeypatch.setitem(OBJECTIVES, Counted.name, Recorded)
    plain = run(config(tmp_path, "sft"))
    cfg = config(tmp_path, "counted")
    cfg.training.method = Counted.name
    counted = run(cfg)
    (objective,) = made
    assert [s for s, rehearsal, _ in objective.steps if not rehearsal] == [1, 2, 3]
    assert all(n == 2 for _, _, n in objective.steps)  # two micro-batches a step, as planned
    assert objective.collated >= 6

    steps = [e for e in counted if isinstance(e, StepMetrics)]
    # The objective's metric is summed over the step's forwards: its trained tokens.
    assert [e.metrics["trained_tokens_seen"] for e in steps] == [float(e.trained_tokens) for e in steps]
    # Same loss, same numbers: the hooks changed nothing the run trains.
    assert [e.loss for e in steps] == pytest.approx([e.loss for e in plain if isinstance(e, StepMetrics)], rel=1e-6)
    assert all(not e.metrics for e in plain if isinstance(e, StepMetrics))  # SFT reports none
    (ev,) = [e for e in counted if isinstance(e, EvalMetrics)]
    assert ev.metrics["trained_tokens_seen"] == ev.tokens


def test_objectives_import_nothing_from_the_session_or_the_studio():
    """Every import in engine/train/objectives, lazy ones inside functions too: an objective is a
    part the session uses, so it never reaches back into the session (or up into the window).
    The import-linter contract in pyproject.toml says the same for the installed tree."""
    import ast
    from pathlib import Path

    import engine.train.objectives as package

    forbidden = ("studio", "PySide6", "engine.train.session", "engine.api")
    files = sorted(Path(package.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "base.py", "sft.py"}
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(path.name, n) for n in names]
    assert found, "no imports seen: the check would pass anything"
    bad = [(f, n) for f, n in found if any(n == p or n.startswith(p + ".") for p in forbidden)]
    assert not bad, bad
