"""FSDP2 for a base that does not fit one device: `fully_shard` per decoder layer and the root.

With `training.distributed: fsdp` (or "auto" when the 16-bit base is over one device's memory
budget and the family carries no state along a row, engine.hardware.policy.distributed_default:
those stay on DDP) under torchrun, each rank holds 1/N of the frozen base and of the adapters
instead of all of them:

- `shard(model, loss_fn, device)` wraps the PEFT model in a loss module (its forward is the
  engine's forward_loss), shards every decoder layer as its own FSDP unit and the loss module as
  the root (the embeddings, final norm and LM head). Every forward goes through the root, so the
  root's parameters are gathered for the whole of forward_loss, the fused cross-entropy's read
  of the head weight included; inside a decoder layer's forward its parameters are plain
  tensors, which is what the patched forwards (engine.fastpath) and the fused LoRA Functions read;
  offloaded checkpointing wraps the whole layer call, FSDP's hooks included, so the recompute
  gathers the layer again like the forward did.
- gradients: FSDP reduce-scatters the adapter gradients (the frozen base has none) averaged over
  the ranks, like DDP, so the session scales each rank's loss by the world size exactly as it
  does for DDP. `sync_context` skips the reduction for all but a rank's last micro-batch.
- parameters become DTensors (each rank's shard); the optimizer is built over them after
  sharding. Checkpoints hold full tensors: `full_adapter_state` and `full_optimizer_state`
  gather them (collectives: every rank calls them, rank 0 writes), `load_adapter_state` and
  `load_optimizer_state` put full tensors back as each rank's shard, so a checkpoint written by
  2 FSDP processes resumes on 1 process (plain tensors) and the other way round.
- `local_tree` / `restore_optimizer_local` are the in-memory rollback snapshot's view: each
  rank keeps its own shards in host memory (no gathering).

Loading: each rank loads the model once onto the CPU, then `shard` moves one decoder layer at a
time to its device and keeps only that rank's shard there, so no device ever holds the whole
base. Host RAM: transformers leaves CPU weights whose file dtype is the run's dtype as mmapped
safetensors pages (measured: loading a 589 MiB bf16 folder and reading every weight adds ~583
MiB of shared, not private, memory), so the ranks share one copy in the page cache: about the
base's size once, plus a layer in flight per rank. Weights that need a dtype conversion (an fp16
or fp32 folder trained in bf16) become private copies, so then N times the base's size (not
measured).

A family whose layers carry state along a row (Arch.row_state: LFM2, Jamba, Nemotron-H, Qwen3.5,
...), one not checked to keep packed documents apart, or one whose stock attention mixes them
while the engine's packed attention is off (engine.models.arch.packing), is refused too
(`alone_refusal`): engine.train.step runs each document of its packed rows as its own
forward, every forward gathers each layer from all ranks, and ranks holding different
numbers of documents would call different numbers of gathers and wait on each other forever. DDP
has no such wait: its one collective, the gradients' all-reduce, runs once per backward whatever
the forwards inside it (tests/engine/train/test_fsdp_row_state.py runs two gloo ranks that way).

A 4-bit base is refused up front (engine.config.FSDP_4BIT_REFUSAL). Tried with bitsandbytes 0.50
on gloo: fully_shard turns a Params4bit (quant_storage bf16) into a plain DTensor and the gathered
weight comes back without its quant_state ("quant_state is required" in the forward); with the
state parked on the module, bitsandbytes' own forward recovers it, but the engine's fused paths
read the weight's state, and loading would quantize the whole base on every GPU first.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch import nn


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def decoder_layers(model) -> list[nn.Module]:
    """The decoder layers of a (PEFT-wrapped) causal LM: the FSDP units."""
    from engine.peft_model import hf_model

    decoder = hf_model(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no .layers: FSDP shards decoder layers")
    return list(layers)


class LossModule(nn.Module):
    """The FSDP root: forward(batch, normalizer) is `loss_fn(inner, batch, normalizer)`."""

    def __init__(self, inner: nn.Module, loss_fn: Callable):
        super().__init__()
        self.inner = inner
        self._loss_fn = loss_fn

    def forward(self, batch, normalizer):
        return self._loss_fn(self.inner, batch, normalizer)


def mesh_for(device: torch.device, world_size: int):
    """The 1-D device mesh over all ranks ("cuda" under NCCL, "cpu" under gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if device.type == "cuda" else "cpu", (world_size,))


def alone_refusal(model_type: Optional[str], packed_attention: bool = True) -> Optional[str]:
    """Why FSDP cannot train `model_type` (a sentence naming it), or None when it can: each
    document of its packed rows runs alone (engine.models.arch.packing), its layers carrying state
    along a row or its family not checked to pack."""
    from engine.models.arch.packing import documents_alone

    # None for a model_type not known yet: shard() asks again once the model has loaded.
    return _refusal(model_type, documents_alone(model_type, packed_attention))


def _refusal(model_type: Optional[str], alone: Optional[str]) -> Optional[str]:
    """alone_refusal's sentence for a model whose documents run alone for reason `alone` (None: none)."""
    if alone is None:
        return None
    return (
        f"fsdp cannot train {model_type}: {alone}, so each document of a "
        "packed row is its own forward, and under FSDP every forward gathers each layer from all GPUs; "
        "GPUs holding different numbers of documents would wait on each other forever. Use DDP "
        "(training.distributed: ddp; with model.load_in_4bit: true if the 16-bit base does not fit one "
        "GPU) or one GPU"
    )


def shard(model: nn.Module, loss_fn: Callable, device: torch.device, world_size: int) -> LossModule:
    """fully_shard each decoder layer, then the loss module around `model` as the root; returns
    the root, whose forward(batch, normalizer) is the loss. `model` may sit on the CPU (or the
    meta device): each unit moves to `device` when it is sharded, one layer at a time.
    Refuses (ConfigError) a model `alone_refusal` refuses: the run's setup refused it before
    loading when its config.json was on disk; this is the check for one that was not."""
    from torch.distributed.fsdp import fully_shard

    from engine.peft_model import hf_model
    from engine.train.step import documents_alone

    base = hf_model(model)
    # As loaded: whether the engine's packed attention runs it is the step's own question.
    why = _refusal(getattr(base.config, "model_type", None), documents_alone(base))
    if why:
        from engine.config import ConfigError

        raise ConfigError("training.distributed", why)
    mesh = mesh_for(device, world_size)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    root = LossModule(model, loss_fn)
    fully_shard(root, mesh=mesh)
    return root


@contextmanager
def root_gathered(root):
    """The root's own weights (embeddings, final norm, LM head) gathered whole for a while: a
    generation calls the decoder and the head directly, not through the root's forward, whose
    hooks would gather them. The decoder layers still gather themselves in their own forwards
    (one layer whole at a time, as in training), so every rank must make the same calls
    (collectives): the gallery agrees on each token, `generate` takes synced_gpus.

    GRPO samples its first groups before any training forward: FSDP2 names as its root the first
    unit whose forward runs, so the root is initialised here first (else the first decoder layer
    called would become it, and the real root's first forward fails)."""
    root._get_fsdp_state()._lazy_init()  # a no-op once a forward has run
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def sync_context(root, last: bool):
    """Reduce-scatter the gradients only after this rank's last micro-batch of the step (the
    others accumulate unsharded adapter gradients, which are small)."""
    from contextlib import nullcontext

    root.set_requires_gradient_sync(last)
    return nullcontext()


# -- full tensors for checkpoints (collectives: every rank calls them in the same order) --------


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (gathered from the ranks for a DTensor)."""
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach().cpu()


def adapter_key(name: str, adapter: str = "default") -> str:
    """A parameter's name as PEFT saves it (the adapter name dropped), e.g.
    `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`."""
    return name.replace(f".{adapter}.", ".")


def full_adapter_state(model) -> dict[str, torch.Tensor]:
    """{parameter name: full CPU tensor} of every trainable parameter (the adapters), named as in
    model.state_dict(); PEFT's save_pretrained(state_dict=...) takes it as is."""
    return {name: full(p) for name, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model, weights: dict[str, torch.Tensor], adapter: str = "default") -> list[str]:
    """Copy a saved PEFT adapter (full tensors, PEFT's names) into a sharded model's trainable
    parameters, each rank its own shard. Returns the saved names that match no parameter."""
    from torch.distributed.tensor import distribute_tensor

    left = dict(weights)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            key = adapter_key(name, adapter)
            saved = left.pop(key, None)
            if saved is None:
                raise RuntimeError(f"the adapter has no weight for {key}")
            if is_dtensor(p):
                local = distribute_tensor(
                    saved.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None
                ).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(saved.to(p.device, p.dtype))
    return sorted(left)


def _params_in_order(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer) -> dict:
    """optimizer.state_dict() with every sharded state (AdamW's moments) gathered whole onto the
    CPU: the same layout a one-process run saves, so either resumes the other."""
    sd = optimizer.state_dict()
    state = {}
    for idx, s in sd["state"].items():
        state[idx] = {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer, sd: dict) -> None:
    """Load a full optimizer state dict (from any world size) into an optimizer over sharded
    parameters: each state tensor shaped like its parameter becomes this rank's shard."""
    from torch.distributed.tensor import distribute_tensor

    params = _params_in_order(optimizer)
    state = {}
    for idx, s in sd["state"].items():
        p = params[int(idx)]
        if is_dtensor(p):
            s = {
                k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
                else v
                for k, v in s.items()
            }
        state[idx] = s
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


# -- the rollback snapshot: each rank's own shards, in host memory -----------------------------


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def local_tree(obj):
    """`obj` (a nested state) with every DTensor replaced by its local shard."""
    if isinstance(obj, torch.Tensor):
        return local(obj)
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def restore_optimizer_local(optimizer, sd: dict) -> None:
    """Load a state dict of local shards (`local_tree` of optimizer.state_dict()) back into an
    optimizer over sharded parameters (each shard wrapped again as its parameter's DTensor)."""
    from torch.distributed.tensor import DTensor

    params = _params_in_order(optimizer)
    state = {}
    for idx, s in sd["state"].items():
        p = params[int(idx)]
        if is_dtensor(p):
            s = {
                k: DTensor.from_local(
                    v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
                if isinstance(v, torch.Tensor) and v.dim() > 0
                else v
                for k, v in s.items()
            }
        state[idx] = s
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
