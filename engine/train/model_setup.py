"""The session's model step: the base loaded, LoRA attached, the fast paths on, the run's forward,
and under torchrun the DDP or FSDP2 wrapper the training forwards run through.

`setup_model` returns a ModelSetup; it reads the config and the device the run setup chose
(engine.train.run_setup) and logs what it loaded and what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from engine.config import RunConfig
from engine.train.distributed import DistContext
from engine.train.objectives.base import Forward


@dataclass
class ModelSetup:
    """The model the run trains and how a training forward reaches it."""

    model: Any  # the prepared model (engine.train.step.PreparedModel.model)
    prepared: Any  # engine.train.step.PreparedModel: its offloader and the fast-path report
    forward: Forward  # the run's forward (fused CE, packed metadata, offloader)
    ddp: Any  # DDP, or the FSDP2 root: what a training forward runs through; None with one process
    params: list  # the LoRA parameters, the only ones that train
    graphs: Any = None  # engine.train.step_graph.StepGraphs where the run's micro-batches replay, else None


def setup_model(
    config: RunConfig,
    device,
    dist: DistContext,
    fsdp: bool,
    init_adapter: Optional[Path],
    objective,
    offloader: Callable[[], Any],
    log: Callable[..., None],
) -> ModelSetup:
    """The model with LoRA attached and the fast paths on (engine.train.step.prepare_model).
    `offloader`: the memory settings' current offloader, asked at each forward (out-of-memory
    recovery may install or change it mid-run)."""
    from engine.models.loading import load_model, quiet_third_party
    from engine.models.lora import attach_lora, lora_parameters
    from engine.train.step import prepare_model

    t = config.training
    # FSDP: the whole base goes to host memory once, then one decoder layer at a time to the
    # device, where each rank keeps its shard (engine.train.fsdp.shard).
    load_on = "cpu" if fsdp else device
    log(f"Loading model {config.model.name_or_path} on {load_on} ({config.model.dtype})")
    model = load_model(config.model, load_on, config.model.dtype)
    with quiet_third_party():  # PEFT's FutureWarnings about transformers internals
        model = attach_lora(model, config.lora)
    if init_adapter is not None:
        from engine.peft_model import load_init_adapter

        n = load_init_adapter(model, init_adapter)
        log(f"LoRA starts from the adapter in {init_adapter} ({n} tensors)")
    if not fsdp:
        # Every family the probe would look at is one not checked to pack, which fsdp.shard
        # refuses below: under FSDP the probe's forward would be spent for nothing.
        _check_logits(model, log)
    # Offloaded checkpointing works under FSDP too: the layer's FSDP hooks run inside the
    # offloader's Function, gathering the weights for the forward and again for the recompute.
    prepared = prepare_model(
        model,
        config.fast_paths,
        device,
        bool(t.gradient_checkpointing),
        offload=t.offload,
        auto_reasons=config.auto_reasons,  # an "off" the policy chose says so, with its reason
    )
    prepared.report.update(objective.fast_paths)  # the method's own (GRPO's decode loop), one report
    chunk = config.fast_paths.ce_chunk_tokens
    forward = Forward(
        fused_ce=prepared.report.get("fused_ce", "on") == "on",
        cached_metadata=config.fast_paths.cached_metadata,
        ce_chunk_tokens=None if chunk == "auto" else int(chunk),
        offloader=offloader,
    )

    def loss(model, batch, normalizer):
        """What DDP's / FSDP's module runs: the objective's loss through the run's forward."""
        return objective.loss(forward, model, batch, normalizer)

    if fsdp:
        from engine.train import fsdp as fsdp_shard

        ddp = fsdp_shard.shard(prepared.model, loss, device, dist.world_size)
        log(
            f"FSDP2: the base and the adapters are sharded across {dist.world_size} processes "
            f"({len(fsdp_shard.decoder_layers(prepared.model))} decoder layers and the root)"
        )
    else:
        # Several processes: DDP over the adapters' gradients (None with one process).
        ddp = dist.wrap(prepared.model, loss, device)
    model.train()
    params = lora_parameters(model)
    graphs = _step_graphs(config, device, dist.enabled, objective, prepared, forward, offloader, params)
    n_train = sum(p.numel() for p in params)
    log(
        f"LoRA: {n_train:,} trainable parameters; fast paths: "
        + ", ".join(f"{k}={v}" for k, v in prepared.report.items())
    )
    return ModelSetup(prepared.model, prepared, forward, ddp, params, graphs)


def _step_graphs(config, device, distributed: bool, objective, prepared, forward, offloader, params):
    """The run's StepGraphs, or None; its line in the fast-path report either way."""
    from engine.fastpath.host_embed import host_embedding
    from engine.peft_model import hf_model
    from engine.train.step import lean_under_graphs
    from engine.train.step_graph import StepGraphs, device_memory, graph_choice

    model = prepared.model
    on, why = graph_choice(
        config.fast_paths.cuda_graphs,
        device=device,
        objective=objective.name,
        distributed=distributed,
        prepared=prepared,
        model=model,
        lora_dropout=float(config.lora.dropout),
        memory=device_memory(device),
    )
    prepared.report["cuda_graphs"] = f"{'on' if on else 'off'}: {why}"
    if not on:
        return None
    lean_under_graphs(prepared, config.fast_paths.lean_recompute)

    def usable():
        # The memory recovery may change the run under the graphs (engine.train.recovery); a
        # change it makes drops the graphs (StepRunner.drop_partial_step), and they are captured
        # again under it, except for this one.
        if host_embedding(hf_model(model)) is not None:
            return "the embedding table moved to host memory to fit the step"
        return None

    def version():
        off = offloader()  # its pinned host buffers, which the graphs copy layer inputs to
        return None if off is None else (id(off), off.host_generation)

    def loss(batch, normalizer):
        return objective.loss(forward, model, batch, normalizer).loss

    return StepGraphs(loss, params, device, usable, version)


def _check_logits(model, log: Callable[..., None]) -> None:
    """For a family nobody here has checked (engine.models.logits_check): refuse it, before any
    step, where the engine's loss would not see the logits its own forward computes."""
    from engine.models.loading import ModelLoadError
    from engine.models.logits_check import logits_mismatch, needs_check
    from engine.peft_model import hf_model
    from engine.train.step import decoder_and_head

    model_type = getattr(hf_model(model).config, "model_type", None)
    if not needs_check(model_type):
        return
    why = logits_mismatch(*decoder_and_head(model))
    if why:
        raise ModelLoadError(why)
    log(f"{model_type} is a family tunesmith has not checked: its logits match the engine's loss on a probe")
