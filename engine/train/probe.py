"""The live probe: while a run is paused between steps, another thread talks to its current
weights. The loop takes the same lock (RunControl.probe_lock) before it resumes, so a probe in
flight finishes first; the answer goes through the gallery's side-effect-free generation, so no
weight, RNG state or data position changes and resuming stays exact.
"""

from __future__ import annotations


class ProbeUnavailable(RuntimeError):
    """`TrainingSession.probe` was called while the run is not paused between steps (or it runs
    in several processes); the message says which."""


def probe(control, gallery, several: bool, prompt: str, max_new_tokens: int) -> tuple[int, str]:
    """(step, reply) of the current weights to `prompt` (greedy, through the chat template for a
    chat run). `control`: the run's RunControl; `gallery`: its Gallery (None before the run is
    set up); `several`: the run has several processes. ProbeUnavailable when it cannot answer."""
    from engine.train import evaluation

    if several:
        raise ProbeUnavailable("A run in several processes cannot be probed from the window.")
    with control.probe_lock:
        step = control.paused_at
        if step is None or gallery is None:
            raise ProbeUnavailable("The run is not paused: pause it to talk to its current weights.")
        ids = evaluation.encode_prompt(gallery.tokenizer, prompt, gallery.chat, gallery.thinking)
        return step, gallery.answers([ids], max_new_tokens, device=gallery.runner.device)[0]
