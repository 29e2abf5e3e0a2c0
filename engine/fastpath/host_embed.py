"""Input embeddings kept in host memory: the frozen token table leaves the GPU.

A model whose input embedding is not tied to its output head looks the input tokens up in a
table it never trains (LoRA leaves it frozen) and never needs whole on the device: Qwen3-8B's
is 151,936 x 4,096 bf16, 1.16 GiB, a sixth of an 8 GB laptop card. `HostEmbedding` replaces
that module: the table moves to pinned host memory, each forward gathers its tokens' rows on
the CPU and sends only them (a 8,192-token micro-batch at hidden 4,096: 64 MiB) to the device
with a non-blocking copy. The output is bit-identical to the table's lookup on the device (a
gather copies rows, it computes nothing).

The training step hands the batch's host copy of the ids (PackedBatch.host_ids), so nothing is
read back from the device; generation hands device ids, which are copied to the host first
(one small sync per generated token, where the forward is tiny anyway).

A tied table (the output head multiplies by the same weight) moves too: the head becomes a
`HostHead` (engine.fastpath.host_head) over the same pinned table, and the loss streams the
table through the device in vocabulary slices, once per micro-batch. That costs the copy (0.72
GiB for Qwen3-4B, hidden under the slices' matmuls only in part), so the session makes the
untied move first and the tied one after the free changes (engine.train.session), when the
pre-flight or a step runs short, or from the start with `fast_paths.host_embeddings: true`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class HostEmbedding(nn.Module):
    """An nn.Embedding's frozen table in pinned host memory; forward(ids) -> rows on `device`.

    The table is a plain attribute, not a parameter or buffer: `model.to(device)` must not move
    it back, and it is never trained or saved (adapters and checkpoints hold LoRA weights only;
    exports load the base from its folder)."""

    def __init__(self, embedding: nn.Embedding, device: torch.device):
        super().__init__()
        weight = embedding.weight.detach()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = getattr(embedding, "padding_idx", None)
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        host = torch.empty(weight.shape, dtype=weight.dtype, device="cpu", pin_memory=pin)
        host.copy_(weight)
        self.host_weight = host

    @property
    def weight(self) -> torch.Tensor:
        """The table (on the host), for code that reads an embedding's dtype or shape."""
        return self.host_weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != "cpu":
            ids = ids.cpu()  # generation's ids: a small copy back (see the module docstring)
        flat = ids.reshape(-1)
        pin = self.device.type == "cuda"
        rows = torch.empty((flat.numel(), self.embedding_dim), dtype=self.host_weight.dtype, pin_memory=pin)
        torch.index_select(self.host_weight, 0, flat, out=rows)
        rows = rows.view(*ids.shape, self.embedding_dim)
        # From pinned memory the copy is asynchronous; the caching host allocator keeps `rows`
        # until the copy has read it.
        return rows.to(self.device, non_blocking=pin)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, in host memory"


def host_embedding(model) -> Optional[HostEmbedding]:
    """The model's HostEmbedding, or None when its input embedding is on the device."""
    from engine.peft_model import hf_model

    emb = hf_model(model).get_input_embeddings()
    return emb if isinstance(emb, HostEmbedding) else None


def why_not(model, device) -> str:
    """Why the input embedding cannot move to host memory ("" when it can)."""
    from engine.peft_model import hf_model

    base = hf_model(model)
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    if isinstance(emb, HostEmbedding):
        return "already in host memory"
    if torch.device(device).type != "cuda":
        return "the model is not on a GPU"
    if not isinstance(emb, nn.Embedding):
        return f"the input embedding is a {type(emb).__name__}, not an nn.Embedding"
    if emb.weight.requires_grad:
        return "the input embedding is trained"
    if is_tied(model):
        if type(head) is not nn.Linear:
            return f"its tied output head is a {type(head).__name__}, not a plain nn.Linear"
        if head.bias is not None:
            return "its tied output head has a bias"
    return ""


def is_tied(model) -> bool:
    """Does the model's output head multiply by its input embedding's table (on the device)?"""
    from engine.peft_model import hf_model

    base = hf_model(model)
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    weight = getattr(emb, "weight", None)
    return weight is not None and head is not None and getattr(head, "weight", None) is weight


def move_to_host(model, device) -> str:
    """Move the model's input embedding to host memory; its report line ("on: ..." or "off: why")."""
    from engine.peft_model import hf_model

    why = why_not(model, device)
    if why:
        return f"off: {why}"
    base = hf_model(model)
    tied = is_tied(model)
    emb = base.get_input_embeddings()
    size = emb.weight.numel() * emb.weight.element_size()
    hosted = HostEmbedding(emb, torch.device(device))
    base.set_input_embeddings(hosted)
    if tied:  # the head reads the same pinned table, streamed by the loss
        from engine.fastpath.host_head import HostHead

        base.set_output_embeddings(HostHead(hosted.host_weight, torch.device(device)))
    del emb  # the device table is freed with the last reference (the caller empties the cache)
    where = "; the tied head streams it" if tied else ""
    return f"on: {size / 2**30:.2f} GiB table in host memory{where}"
