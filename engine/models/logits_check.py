"""Whether the engine's loss sees the logits a family's stock forward computes.

Every loss the engine builds (engine.train.step, the objectives) takes the decoder's last hidden
states and the output head's weight, scaled by the family's logit scale (Arch.logit_scale), and
never calls the model's own head. That is the stock logits for each family the engine has a file
for or has checked (engine.models.arch.packing, each with a test). A family nobody has checked may
do more between its last hidden state and its logits: a scale under a name of its own (Cohere2-MoE),
a softcap, a transform and norm before the head (BERT-style heads). Trained on the wrong logits it
would learn something else and say nothing, so `logits_mismatch` runs a few tokens both ways before
training and the run is refused, with the difference, where they part.
"""

from __future__ import annotations

from typing import Optional

import torch

# Tokens the probe runs: few, so it costs a short forward of any model, and inside any vocabulary.
PROBE_TOKENS = 8
# Same modules and dtype on both sides: exact for a plain head, within bf16's rounding for a scaled
# one (the scale is taken before the head here and after it in the stock forward). A family doing
# anything else parts by far more (a 0.25 scale: 75% of the largest logit).
RELATIVE_TOLERANCE = 2e-2


def needs_check(model_type: Optional[str]) -> bool:
    """Whether `model_type` is a family whose logits nobody here has checked: no file of ours and
    not in the packing list's checked families."""
    from engine.models.arch import arch_for
    from engine.models.arch.packing import PACKED_ROWS_CHECKED

    return arch_for(model_type) is None and model_type not in PACKED_ROWS_CHECKED


def logits_mismatch(base, decoder, head) -> Optional[str]:
    """None where head(decoder's last hidden state x the logit scale) gives the stock forward's
    logits on a few tokens; otherwise why not, as a sentence naming the model_type. `base`: the
    transformers model; `decoder`, `head`: its decoder and output head (engine.train.step)."""
    from engine.models.arch import logit_scale

    cfg = base.config
    model_type = getattr(cfg, "model_type", None)
    device = head.weight.device
    vocab = int(head.weight.shape[0])
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
    was_training = base.training
    base.eval()  # no dropout: both sides must see the same activations
    try:
        with torch.no_grad():
            stock = base(input_ids=ids, use_cache=False).logits.float()
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            ours = head(hidden * logit_scale(cfg)).float()
    except Exception as exc:  # a decoder that does not take input_ids, a head of another shape, ...
        return (
            f"model_type {model_type!r}: the engine computes its loss from the decoder's last hidden states "
            f"and the output head, and running this model that way failed ({type(exc).__name__}: {exc})"
        )
    finally:
        base.train(was_training)
    if ours.shape != stock.shape:
        return (
            f"model_type {model_type!r}: its output head gives logits of shape {tuple(ours.shape)} where the "
            f"model's own forward gives {tuple(stock.shape)}"
        )
    largest = stock.abs().max().item()
    diff = (ours - stock).abs().max().item()
    if diff <= RELATIVE_TOLERANCE * max(largest, 1e-6):
        return None
    return (
        f"model_type {model_type!r}: its own forward computes logits that its last hidden states and output "
        f"head do not give (they differ by up to {diff:.3g}, the largest logit being {largest:.3g}): it scales, "
        "caps or transforms them in a way the engine does not know, and training on other logits would teach "
        "it something else. Train a family tunesmith knows, or ask for this one to be added"
    )
