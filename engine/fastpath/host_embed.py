"""Input embeddings kept in host memory: the frozen token table leaves the GPU.

A model whose input embedding is not tied to its output head looks the input tokens up in a
table it never trains (LoRA leaves it frozen) and never needs whole on the device: Qwen3-8B's
is 151,936 x 4,096 bf16, 1.16 GiB, a sixth of an 8 GB laptop card. `HostEmbedding` replaces
that module: the table moves to pinned host memory, each forward gathers its tokens' rows on
the CPU and sends only them (a 8,192-token micro-batch at hidden 4,096: 64 MiB) to the device
with a non-blocking copy. The output is bit-identical to the table's lookup on the device (a
gather copies rows, it computes nothing).

Families that scale the lookup inside the embedding module (Gemma 1-3's ScaledWordEmbedding:
the rows times sqrt(hidden) cast to the table's dtype; BART-style ones by a float) keep the
scale: the rows are multiplied on the device, the same op as the module's. Before the table moves,
a probe of a few ids through both must agree bit for bit; an embedding whose forward does more
than a (scaled) lookup stays on the device.

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
        # The module's own scale of its rows, as its forward applies it (None: a plain lookup).
        scale = getattr(embedding, "embed_scale", None)
        if torch.is_tensor(scale):
            scale = scale.detach().to(device=self.device, dtype=weight.dtype)
        self.scale = scale

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
        rows = rows.to(self.device, non_blocking=pin)
        return rows if self.scale is None else rows * self.scale

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


def same_lookup(embedding: nn.Module, hosted: HostEmbedding) -> bool:
    """Does the host table give the embedding module's output, bit for bit, on a probe of ids (the
    first, second and last row)? False for a module whose forward does more than a scaled lookup."""
    ids = torch.tensor([[0, 1, hosted.num_embeddings - 1]], device=embedding.weight.device)
    with torch.no_grad():
        want = embedding(ids)
        got = hosted(ids)
    return want.dtype == got.dtype and torch.equal(want, got.to(want.device))


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
    if not same_lookup(emb, hosted):
        return f"off: its input embedding ({type(emb).__name__}) does more than a scaled lookup"
    base.set_input_embeddings(hosted)
    if tied:  # the head reads the same pinned table, streamed by the loss
        from engine.fastpath.host_head import HostHead

        base.set_output_embeddings(HostHead(hosted.host_weight, torch.device(device)))
    del emb  # the device table is freed with the last reference (the caller empties the cache)
    where = "; the tied head streams it" if tied else ""
    return f"on: {size / 2**30:.2f} GiB table in host memory{where}"
