"""The training objective: what a run learns, as a part the session asks and never inspects.

An objective owns everything that differs between training methods (SFT today; DPO, ORPO,
SimPO, KTO and GRPO are the next ones), and nothing that does not (the optimizer, the step
plan, recovery, rollback, the pre-flight, checkpoints, eval scheduling, the gallery, pause and
stop stay in the session's parts). The session calls, in this order:

setup, once:
  `prepare_data(tokenizer)`              the examples, packed into rows (a TrainingData)
  `held_out(data, tokenizer)`            (training data, HeldOut or None, a sentence for the log)
  `example_tokens(data)`                 each example's tokens (the pre-flight's longest rows,
                                         the eval schedule's step size)
every optimizer step (and the pre-flight's rehearsal, with `rehearsal=True`):
  `collate(data, example_ids)`           one forward's examples -> a batch on the host
  `prepare_step(ctx, micro)`             hook before the forwards: GRPO generates its groups
                                         here and returns the batches it built from them;
                                         DPO may run its reference pass here (with
                                         `ctx.adapters_off()`) and attach the log-probs
  `normalizer(batches)`                  the whole step's loss divisor (SFT: trained tokens)
  `loss(ctx.forward, model, batch, normalizer)` -> LossOutput per forward (the session
                                         backpropagates `.loss`, sums `.metrics`)
  `step_metrics(sums)`                   floats for StepMetrics.metrics (after the step's sync)
  `step_samples()`                       at log steps: the step's generated samples, if any
between steps:
  `eval_batches(held_out, row_tokens, rows)` once, then at every eval `prepare_eval(ctx,
  batches)` -> the batches to evaluate (DPO's reference log-probs of the held-out pairs,
  computed once; GRPO's greedy answers, scored), `normalizer` of those, and `loss` over them
  with no grad, the sum of `.loss` being EvalMetrics.eval_loss and `eval_metrics(sums)` its
  metrics. The best checkpoint is the lowest eval loss, so a method whose measure rises when
  it gets better reports it negated (GRPO: minus the mean reward).

A batch is whatever `collate` returns; the session needs from it only `to(device)`,
`num_tokens`, `num_trained_tokens` (for StepMetrics) and `info.free()` (a PackedBatch has all;
a method's batch may subclass it and carry more, e.g. which documents of a packed row are the
chosen and which the rejected answers). Everything on the device a loss needs must come from
the batch or from `forward`, never from a global: two sessions may run in one process.

Objectives register by name (`engine.train.objectives.register`); `training.method` picks one.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional


class LossOutput(NamedTuple):
    """One forward's result. `loss`: the scalar the session backpropagates, already divided by
    the step's normalizer (so a step's forwards add up to the step's loss). `metrics`: detached
    device tensors the session sums over the step's forwards (and over ranks) and hands to
    `step_metrics`; reading them costs a sync, so SFT returns none. A NamedTuple so that DDP and
    FSDP see the loss tensor in the module's output."""

    loss: Any  # torch.Tensor
    metrics: dict = {}


@dataclass
class Forward:
    """The run's forward, with the settings that recovery may change while the run goes (the
    offloader appears or changes mode): an objective calls it, never forward_loss's knobs.

    `hidden(model, batch)` -> (transformers model, last hidden states [tokens, hidden], head):
    the decoder over a packed batch, on the fast paths, for a loss of the objective's own (a
    per-token log-prob from the fused path, a value head). `cross_entropy(model, batch,
    normalizer)`: the summed next-token loss over the batch's trained targets / normalizer."""

    fused_ce: bool = True
    cached_metadata: bool = True
    ce_chunk_tokens: Optional[int] = None
    offloader: Callable[[], Any] = lambda: None  # the current ActivationOffloader or None

    def hidden(self, model, batch):
        from engine.train.step import decoder_hidden

        return decoder_hidden(model, batch, self.cached_metadata, self.offloader())

    def cross_entropy(self, model, batch, normalizer):
        from engine.train.step import forward_loss

        return forward_loss(
            model,
            batch,
            normalizer,
            fused_ce=self.fused_ce,
            cached_metadata=self.cached_metadata,
            ce_chunk_tokens=self.ce_chunk_tokens,
            offloader=self.offloader(),
        )


@dataclass
class StepContext:
    """What `prepare_step` may use: the model, where it runs, and the run's forward. The hooks
    a method needs beyond the loss are here, so the session has none of its own."""

    model: Any
    device: Any
    tokenizer: Any
    forward: Forward
    step: int  # 1-based, as StepMetrics numbers it
    rehearsal: bool = False  # the pre-flight's forward + backward, not a training step
    # The FSDP2 root when the base is sharded (engine.train.fsdp), else None: a generation or a
    # reference pass calls `model` directly, not through the root, so the root's weights must be
    # gathered around it (`gathered`) and every rank must make as many forwards (`synced`).
    sharded: Any = None

    @property
    def synced(self) -> bool:
        """Every rank must run the same forwards (FSDP): transformers' generate(synced_gpus=...)
        keeps a rank whose sequences ended stepping until every rank's have."""
        return self.sharded is not None

    @contextmanager
    def gathered(self):
        """The root's weights gathered whole under FSDP (engine.train.fsdp.root_gathered); nothing
        to do with one process or DDP."""
        if self.sharded is None:
            yield
            return
        from engine.train.fsdp import root_gathered

        with root_gathered(self.sharded):
            yield

    @contextmanager
    def adapters_off(self):
        """The base model alone (PEFT's adapters disabled), without gradients: DPO's and GRPO's
        reference pass, on the same weights in the same process (no second copy)."""
        import torch

        with self.gathered(), self.model.disable_adapter(), torch.no_grad():
            yield

    @contextmanager
    def generating(self):
        """Eval mode and no autograd for a generation phase (GRPO's groups from the current
        policy, adapters on); train mode back after. Unlike the gallery this does not restore
        the RNG: the samples are part of the training step (a rerun after running out of memory
        restores the step's RNG first, so it samples the same groups). The fast-path counters
        come back as they were: StepMetrics' calls and fallbacks describe the training forwards,
        and decoding with a KV cache takes the stock attention by design (counted, it read as a
        fast path that "did not run" on every GRPO step)."""
        import torch

        from engine.counters import current

        was_training = self.model.training
        self.model.eval()
        try:
            with self.gathered(), current().set_aside(), torch.no_grad():
                yield
        finally:
            if was_training:
                self.model.train()


class Objective:
    """The SFT-shaped defaults; a method overrides what differs. Subclasses set `name` and are
    registered with `engine.train.objectives.register`."""

    name: ClassVar[str] = ""
    # Whether a higher loss means a worse model, so a jump above the recent median is a spike the
    # guard rolls back (engine.train.rollback). False where the loss's value says nothing about
    # progress: an on-policy GRPO loss is ~0 (advantages sum to zero per group), so any ordinary
    # step is "many times the median". NaN and inf are guarded either way.
    loss_is_progress: ClassVar[bool] = True
    # Fast paths of the method's own (name -> "on..." or "off: why"), added to the run's fast-path
    # report beside the model's; a step that falls back counts `fallback:<name>: <why>`
    # (engine.counters), which the Monitor names. GRPO: its decode loop.
    fast_paths: ClassVar[dict[str, str]] = {}

    def __init__(self, config):
        self.config = config  # the resolved RunConfig

    # -- data: what a batch holds and how it is packed ------------------------------------------
    def prepare_data(self, tokenizer):
        """The examples read, checked, tokenized and packed: a TrainingData (see PreparedData:
        `packing` with `rows` of example ids and `row_tokens`, `summary()`, `spec`, `skipped`,
        `truncated`, `used_fallback_template`), or a DataError naming the file and row."""
        raise NotImplementedError

    def held_out(self, data, tokenizer):
        """(training data, HeldOut or None, one sentence for the log): the eval examples."""
        return data, None, ""

    def example_tokens(self, data) -> list[int]:
        """Tokens of each example, indexed as `packing.rows` names them."""
        return [len(d) for d in data.docs]

    def collate(self, data, example_ids: list[int]):
        """One forward's examples (their ids, in order) -> a batch on the host."""
        raise NotImplementedError

    def normalizer(self, batches: list) -> int:
        """The loss divisor of a whole optimizer step over its `batches` (every forward of the
        step divides by the same number, so accumulation equals one large batch)."""
        return max(1, sum(b.num_trained_tokens for b in batches))

    # -- the step -----------------------------------------------------------------------------
    def prepare_step(self, ctx: StepContext, micro: list) -> list:
        """Before the step's forwards: [(rows, batch)] -> [(rows, batch)]. The default keeps
        them. Runs again if the step is retried after running out of memory (RNG restored)."""
        return micro

    def loss(self, forward: Forward, model, batch, normalizer) -> LossOutput:
        raise NotImplementedError

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's own metrics from the summed LossOutput.metrics (StepMetrics.metrics)."""
        return dict(sums)

    def step_samples(self) -> list[dict]:
        """What the latest step generated, shown at log steps (CompletionSamples): GRPO's
        completions with their rewards; none for methods that generate nothing."""
        return []

    # -- evaluation ---------------------------------------------------------------------------
    def eval_batches(self, held_out, row_tokens: int, rows_per_batch: int) -> list:
        """The held-out examples as batches, built once per run on the host."""
        raise NotImplementedError

    def prepare_eval(self, ctx: StepContext, batches: list) -> list:
        """Before each eval's forwards (no autograd, eval mode, RNG restored after): the batches
        `loss` runs over, from the held-out `batches` (built once, kept for the run). DPO attaches
        its reference log-probs to them; GRPO answers their prompts greedily and returns scored
        batches. SFT: the batches as they are."""
        return batches

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """EvalMetrics.metrics from the summed LossOutput.metrics of the eval's forwards."""
        return self.step_metrics(sums)
