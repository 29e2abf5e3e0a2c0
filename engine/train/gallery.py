"""The prompt gallery, answered greedily at every checkpoint (GalleryAnswers, gallery.jsonl),
through the run's own packed forward, side-effect free (engine.train.evaluation), so the run
trains on exactly as before. The probe of a paused run (engine.train.probe) asks through here.

The prompts are `training.gallery_prompts` (through the chat template for a chat run), else
the first `training.gallery_size` held-out examples' prompts. Under FSDP every rank takes part
in the forwards (each gathers its layers from all); rank 0 answers and records.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Optional

from engine.events import GalleryAnswers


class Gallery:
    """`runner`: the StepRunner (model, device, FSDP root); `chat`: the run renders chats (a
    typed prompt goes through the chat template); `reporter`, `folder`: where answers go."""

    def __init__(
        self, runner, tokenizer, training, held_out, chat: bool, max_len: int, reporter, folder, thinking=None
    ):
        from engine.train import evaluation

        self.runner, self.tokenizer, self.chat, self.max_len = runner, tokenizer, chat, max_len
        self.thinking = thinking  # data.thinking: typed prompts open the answer as training rendered it
        self.reporter, self.folder, self.dist = reporter, folder, runner.dist
        if training.gallery_prompts:
            self.prompts = [
                (p, evaluation.encode_prompt(tokenizer, p, chat, thinking)) for p in training.gallery_prompts
            ]
        elif held_out is not None and training.gallery_size:
            self.prompts = [
                (tokenizer.decode(ids, skip_special_tokens=True).strip(), ids)
                for ids in held_out.prompt_ids(training.gallery_size)
            ]
        else:
            self.prompts = []
        self.done: set[int] = set()  # steps the gallery answered at, this session

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def run(self, step: int, checkpoint: Path) -> None:
        """The prompts answered by the weights of `step` (GalleryAnswers and gallery.jsonl). A
        failure is logged, never the end of the run."""
        if not self.prompts or not (self.dist.is_main or self.runner.fsdp):
            return
        self.done.add(step)
        try:
            answers = self.answers([ids for _, ids in self.prompts], None)
        except Exception as exc:
            self.reporter.log(f"The gallery at step {step} failed: {type(exc).__name__}: {exc}", "warning")
            return
        if not self.dist.is_main:
            return
        prompts = [p for p, _ in self.prompts]
        try:
            self.folder.append_gallery(
                [
                    {"step": step, "prompt": p, "answer": a, "checkpoint": str(checkpoint)}
                    for p, a in zip(prompts, answers)
                ]
            )
        except OSError as exc:
            self.reporter.log(f"gallery.jsonl was not written at step {step}: {exc}", "warning")
        self.reporter.emit(GalleryAnswers(step, prompts, answers, str(checkpoint)))

    def answers(self, prompts: list[list[int]], max_new_tokens: Optional[int], device=None) -> list[str]:
        from engine.train import evaluation

        runner = self.runner
        n = max_new_tokens or evaluation.GALLERY_NEW_TOKENS
        gathered, agree = nullcontext(), None
        if runner.fsdp:
            from engine.train import fsdp
            from engine.train.distributed import share_from_main

            gathered, agree = fsdp.root_gathered(runner.ddp), partial(share_from_main, self.dist)
        with evaluation.side_effect_free(runner.model, device), gathered:
            outs = evaluation.greedy_answers(
                runner.model,
                prompts,
                n,
                evaluation.stop_token_ids(self.tokenizer),
                runner.device,
                self.max_len,
                agree,
            )
        return [self.tokenizer.decode(out, skip_special_tokens=True).strip() for out in outs]
