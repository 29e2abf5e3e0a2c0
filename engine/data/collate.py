"""PackedBatch: one micro-batch as a single flat token stream of whole documents.

Several packed rows go back to back into one [1, T] stream: attention never crosses a
document boundary, so there is no padding at all and no per-row bookkeeping. Targets are
shifted here, on the host, so that no document's last token is trained to predict the next
document's first token, and the loss needs no shift on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.fastpath.packed import PackedSeqInfo

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 [1, T]
    targets: torch.Tensor  # int64 [1, T]; targets[t] = next token of t's document, or -100
    info: PackedSeqInfo
    num_tokens: int
    num_trained_tokens: int
    # The ids on the host after `to(device)`: an embedding table in host memory
    # (engine.fastpath.host_embed) looks them up without reading the device's copy back.
    host_ids: Optional[torch.Tensor] = None

    @classmethod
    def from_documents(
        cls,
        docs: Sequence[Sequence[int]],
        trained: Sequence[Sequence[bool]] | None = None,
    ) -> "PackedBatch":
        """Pack token-id lists into one stream.

        `trained[i][t]` says whether token t of document i is a response token whose
        prediction is learned (a target is trained when the token it predicts is trained).
        None trains every token.
        """
        if not docs:
            raise ValueError("a batch needs at least one document")
        ids: list[int] = []
        tgt: list[int] = []
        for i, doc in enumerate(docs):
            n = len(doc)
            if n == 0:
                raise ValueError(f"document {i} of the batch is empty")
            mask = trained[i] if trained is not None else None
            ids.extend(doc)
            for t in range(n - 1):
                ok = mask is None or mask[t + 1]
                tgt.append(int(doc[t + 1]) if ok else IGNORE_INDEX)
            tgt.append(IGNORE_INDEX)  # the last token predicts nothing inside its document
        info = PackedSeqInfo.from_lengths([len(d) for d in docs])
        input_ids = torch.tensor(ids, dtype=torch.int64).unsqueeze(0)
        targets = torch.tensor(tgt, dtype=torch.int64).unsqueeze(0)
        n_trained = sum(1 for t in tgt if t != IGNORE_INDEX)
        return cls(input_ids, targets, info, len(ids), n_trained)

    def to(self, device: torch.device | str) -> "PackedBatch":
        device = torch.device(device)
        if device.type == "cpu":
            return self
        nb = torch.cuda.is_available()
        return PackedBatch(
            self.input_ids.pin_memory().to(device, non_blocking=True) if nb else self.input_ids.to(device),
            self.targets.pin_memory().to(device, non_blocking=True) if nb else self.targets.to(device),
            self.info.to(device),
            self.num_tokens,
            self.num_trained_tokens,
            self.input_ids,
        )

    def model_kwargs(self) -> dict:
        """Forward kwargs for a transformers decoder: ids plus the packed metadata."""
        return {"input_ids": self.input_ids, **self.info.model_kwargs()}
