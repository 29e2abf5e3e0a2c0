"""Each step's report on its own (engine.train.step_report): the run's counters read and zeroed
every step, a fallback said once, and StepMetrics every log_every steps and at the last."""

from types import SimpleNamespace

import torch

from engine.config import RunConfig
from engine.counters import Counters, count, count_fallback
from engine.resources import DEMO_PRESET
from engine.train.objectives import objective_for
from engine.train.reporting import Reporter
from engine.train.schedule import StepPlan, lr_lambda
from engine.train.step_report import StepReport


def report_for(events, total=5, log_every=2):
    cfg = RunConfig.load(DEMO_PRESET)
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("linear", 0, total))
    plan = StepPlan(num_rows=10, rows_per_micro_batch=1, grad_accum=2, seed=0)
    # The memory settings as the report reads them: the fast paths asked for, no offloader.
    memory = SimpleNamespace(fast={"packed_attention": "on"}, offloader=None)
    counters = Counters()
    report = StepReport(
        objective_for(cfg),
        memory,
        plan,
        scheduler,
        torch.device("cpu"),
        total,
        1234,
        log_every,
        counters,
        Reporter(events.append),
    )
    return report, counters, scheduler


def batches(*tokens):
    return [SimpleNamespace(num_tokens=n) for n in tokens]


def test_metrics_every_log_every_steps_and_at_the_last(tmp_path):
    events = []
    report, counters, scheduler = report_for(events, total=5, log_every=2)
    lrs = {}
    with counters.active():
        for step in range(1, 6):
            count("metadata_builds")
            count("attention:reference")
            scheduler.optimizer.step()
            scheduler.step()
            lrs[step] = scheduler.get_last_lr()[0]
            report.step(step, batches(100, 28), 90, torch.tensor(0.5), 0.25, {}, 3.0 - step / 10)
    metrics = [e for e in events if e.kind == "StepMetrics"]
    assert [m.step for m in metrics] == [2, 4, 5]
    m = metrics[0]
    assert (m.total_steps, m.tokens, m.trained_tokens, m.loss, m.grad_norm) == (5, 128, 90, 2.8, 0.5)
    assert m.tokens_per_second == 128 / 0.25 and m.step_seconds == 0.25
    assert m.epoch == report.plan.epoch_at(2) == 0.4 and [x.lr for x in metrics] == [lrs[2], lrs[4], lrs[5]]
    assert m.mem_total == 1234 and m.device == "cpu" and m.mem_peak > 0  # the process's RSS on a CPU
    # Counts are per step: each report reads and zeroes them, reported or not.
    assert all(x.metadata_builds == 1 and x.fast_path_calls == {"attention:reference": 1} for x in metrics)
    assert report.tok_per_s == [512.0] * 3


def test_a_fallback_is_said_once_and_counted_in_its_step():
    events = []
    report, counters, _ = report_for(events, total=2, log_every=1)
    with counters.active():
        for step in (1, 2):
            count("attention:reference")
            count_fallback("rmsnorm", "weights on the meta device")
            report.step(step, batches(10), 10, torch.tensor(1.0), 0.5, {}, 1.0)
    said = [e.message for e in events if e.kind == "LogLine" and "fallback" in e.message]
    assert said == ["Fast path fallback in step 1: rmsnorm: weights on the meta device (1 call took the stock path)"]
    metrics = [e for e in events if e.kind == "StepMetrics"]
    assert [m.fallbacks for m in metrics] == [{"rmsnorm: weights on the meta device": 1}] * 2
