"""One micro-batch's forward and loss, shared by the TrainingSession and the benchmark harness.

`prepare_model` switches on the fast paths once and returns a PreparedModel: the model, the
ActivationOffloader it installed (or None) and the report of what is on; `enable_checkpointing`
and `install_offload` add those to a prepared model later (the session's out-of-memory
recovery). `forward_loss` runs the decoder over a
PackedBatch and computes the loss straight from the last hidden states, so the full
[tokens x vocab] logits never exist when the fused cross-entropy is on. The loss is a sum over
trained tokens divided by `normalizer`, the trained-token count of the whole accumulated
optimizer step, so gradient accumulation gives exactly the large-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from engine.config import AUTO, FastPathConfig
from engine.data.collate import IGNORE_INDEX, PackedBatch
from engine.peft_model import hf_model


def _wanted(value) -> bool:
    return value is True or value == AUTO


@dataclass
class PreparedModel:
    """What prepare_model did: the model it switched fast paths on for, the offloader it
    installed into the model's decoder layers (None without offload), and the report
    {fast path: "on" | why off}. forward_loss takes the offloader from here."""

    model: Any
    offloader: Optional[Any] = None  # engine.fastpath.offload.ActivationOffloader
    report: dict[str, str] = field(default_factory=dict)


def prepare_model(
    model,
    fast_paths: FastPathConfig,
    device,
    gradient_checkpointing: bool,
    offload: str = "off",
    auto_reasons: Optional[dict[str, str]] = None,
) -> PreparedModel:
    """Apply the fast paths to a PEFT-wrapped causal LM; return a PreparedModel whose report
    says {fast path: "on" | why off}.

    `offload` ("off", "single", "double"; "auto" is resolved by the hardware policy before
    this) parks each checkpointed layer's input in host memory (engine.fastpath.offload).
    `auto_reasons`: the config's {field path: reason} for the fields the hardware policy filled
    (RunConfig.auto_reasons); a path it turned off then reads "off: auto, the policy chose off:
    <reason>" rather than "disabled in config", which the user did not do.
    """
    device = torch.device(device)
    report: dict[str, str] = {}

    # Packed attention is also what keeps documents apart, so it is on wherever it applies;
    # turning it off (an ablation) leaves transformers to build its own masks from positions.
    if _wanted(fast_paths.packed_attention):
        from engine.fastpath.attention import enable_packed_attention

        report["packed_attention"] = enable_packed_attention(model, cached_metadata=fast_paths.cached_metadata)
    else:
        report["packed_attention"] = "off: disabled in config"

    from engine.models.patches import apply_fast_paths

    report.update(apply_fast_paths(model, fast_paths, device))

    mg = fast_paths.moe_grouping
    if mg is False:
        report["moe_grouping"] = "off: disabled in config"
    elif mg == AUTO and device.type not in ("cuda", "cpu"):
        report["moe_grouping"] = f"off: auto keeps the stock path on {device.type}"
    else:
        from engine.fastpath.moe import apply_moe_grouping

        report["moe_grouping"] = apply_moe_grouping(model, kernels="torch" if fast_paths.kernels is False else "auto")

    report["fused_ce"] = "on" if _wanted(fast_paths.fused_ce) else "off: disabled in config"
    report["cached_metadata"] = "on" if fast_paths.cached_metadata else "off: rebuilt in every layer"

    report["host_embeddings"] = _host_embeddings(model, fast_paths.host_embeddings, device)
    if fast_paths.tiled_mlp is True:
        report["tiled_mlp"] = tile_mlps(model, device)
    else:
        off = "disabled in config" if fast_paths.tiled_mlp is False else "turned on when memory runs short"
        report["tiled_mlp"] = f"off: {off}"

    base = hf_model(model)
    base.config.use_cache = False
    _no_padding_check(base)
    if gradient_checkpointing:
        _checkpoint_layers(base)
    offloader, report["offload"] = _install_offload(
        base, offload, device, gradient_checkpointing, bool(fast_paths.keep_attention), fast_paths.lean_recompute
    )
    lean, why = lean_recompute_choice(fast_paths.lean_recompute, base)
    report["lean_recompute"] = f"{'on' if lean else 'off'}: {why}" if offloader is not None else "off: no offload"
    return PreparedModel(model, offloader, _say_policy_offs(report, auto_reasons or {}))


# Report keys whose switch is not a fast_paths field of the same name.
_REPORT_FIELDS = {"offload": "training.offload"}


def _host_embeddings(model, setting, device) -> str:
    """Move the input table to host memory where `setting` wants it; the report line.

    auto moves it from the start for a 4-bit (QLoRA) base whose table is not tied to its head:
    QLoRA is chosen to save memory, the untied move costs no matmul (measured on W4, Qwen3-14B
    NF4: 11.83 against 13.28 GiB at 0.6% of the speed), and the frozen table is then the largest
    16-bit tensor left on the card after the head. Other bases keep it until memory runs short."""
    from engine.fastpath.host_embed import is_tied, move_to_host

    if setting is True:
        return move_to_host(model, device)
    if setting is False:
        return "off: disabled in config"
    if _has_4bit_layers(model) and not is_tied(model):
        moved = move_to_host(model, device)
        if moved.startswith("on"):
            return moved.replace("on: ", "on: auto for a 4-bit base's untied table, ", 1)
    return "off: moved when memory runs short"


def _has_4bit_layers(model) -> bool:
    from engine.fastpath.quant import is_4bit

    return any(is_4bit(m) for m in model.modules())


def _say_policy_offs(report: dict[str, str], auto_reasons: dict[str, str]) -> dict[str, str]:
    """The report with each "off" that names the config ("disabled in config", "fast_paths.X is
    false") said as the policy's choice where the field was "auto" and the policy filled it."""
    out = dict(report)
    for key, line in report.items():
        if line == "off: disabled in config":
            path = _REPORT_FIELDS.get(key, f"fast_paths.{key}")
        elif line.startswith("off: fast_paths.") and line.endswith(" is false"):
            path = line.removeprefix("off: ").removesuffix(" is false")
        else:
            continue
        if path in auto_reasons:
            out[key] = f"off: auto, the policy chose off: {auto_reasons[path]}"
    return out


def _skip_padding_check(input_ids, attention_mask) -> None:
    """Stands in for transformers' `warn_if_padding_and_no_attention_mask` (see _no_padding_check)."""


def _no_padding_check(base) -> None:
    """Turn off transformers' padding warning on every model of `base`'s tree.

    Packed rows carry no attention mask by design (documents are kept apart by their positions), and
    the check that would warn about it (GPT-2, GPT-BigCode and some sixty other families run it in
    each forward) indexes the ids with a Python list: a CPU tensor copied to the GPU, which a CUDA
    graph's capture refuses (those families fell back from the step graph for it), and a read back
    to the host every step. It only ever warns, so nothing a run computes changes."""
    from transformers import PreTrainedModel

    for module in base.modules():
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = _skip_padding_check


def _checkpoint_layers(base) -> None:
    """Checkpoint the decoder's layers, non-reentrant (it needs no input grads and works with
    frozen embeddings). transformers 5 renamed gradient_checkpointing_enable to
    activation_checkpointing_enable and warns (FutureWarning) on every call of the old name;
    the old name is called only where the installed transformers lacks the new one."""
    # The RNG state is kept for the recompute only where the model draws random numbers: keeping
    # it costs a device-state read per layer, and a CUDA graph cannot read it while capturing.
    kwargs = {"use_reentrant": False, "preserve_rng_state": draws_random(base)}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also hooks the input embeddings so that their output requires grad (what reentrant
    # checkpointing needs). Non-reentrant checkpointing and the offloader (its grad anchor) need no
    # input grads; with the hook the first layer's backward makes an input gradient nobody reads, and
    # the embedding output and that gradient are held through the backward (W3 on the H200: its step's
    # peak fell from 17.53 to 17.41 GiB without it, bench --memory-peak).
    if getattr(base, "_require_grads_hook", None) is not None and hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()


def draws_random(base) -> bool:
    """Whether the model's training forward draws random numbers: a dropout with p > 0 (LoRA's
    included) or attention dropout in its config."""
    if float(getattr(base.config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in base.modules())


def tile_mlps(model, device) -> str:
    """Run the model's dense MLPs over tiles of tokens (engine.fastpath.tiled_mlp), also mid-run
    (the session's out-of-memory recovery); the report line."""
    from engine.fastpath.tiled_mlp import enable_tiled_mlp
    from engine.models.patches import dense_mlps

    mlps, why = dense_mlps(model)
    if not mlps:
        return f"off: {why}"
    inter = getattr(hf_model(model).config, "intermediate_size", 0) or 0
    return enable_tiled_mlp(mlps, inter, torch.device(device))


def enable_checkpointing(model) -> bool:
    """Turn gradient checkpointing on for a prepared model (also mid-run: the session does it
    when a step runs out of memory at one row per micro-batch). False when the architecture
    cannot checkpoint."""
    base = hf_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        return False
    _checkpoint_layers(base)
    return True


# fast_paths.lean_recompute "auto": on from this hidden size. Measured on the H200 in one run each
# (bench --ours-variants all-on,lean_recompute=false, docs/gpu-test-log.md 2026-12-02): Qwen3-8B
# (hidden 4,096) 12,702 against 11,682 tok/s and 17.53 against 18.41 GiB; Qwen3-0.6B (1,024) and
# Llama-3.2-1B (2,048), whose steps are bound by kernel launches, 45,122 against 55,266 and 44,756
# against 52,995 tok/s: the row tiles' extra launches cost more than the skipped matmul saves.
LEAN_RECOMPUTE_MIN_HIDDEN = 4096


def lean_recompute_choice(setting, base, graphs: bool = False) -> tuple[bool, str]:
    """(whether offload's recompute is lean, why) for fast_paths.lean_recompute on this model;
    `graphs`: the run's micro-batches replay CUDA graphs (engine.train.step_graph)."""
    if setting != AUTO:
        return bool(setting), "set in config"
    if graphs:
        # Measured on the H200 in one run each (bench --ours-variants all-on,lean_recompute=true,
        # docs/gpu-test-log.md 2026-12-02, fourth session): with graphs, W1 89,693 against 87,766
        # tok/s (median of 3) and W2 66,707 against 61,219 at 3.41 against 3.79 GiB.
        return True, "CUDA graphs replay the step: the row tiles' extra launches cost no host time"
    hidden = int(getattr(base.config, "hidden_size", 0) or 0)
    if hidden >= LEAN_RECOMPUTE_MIN_HIDDEN:
        return True, f"hidden size {hidden:,} >= {LEAN_RECOMPUTE_MIN_HIDDEN:,}: fewer matmuls, lower peak"
    return (
        False,
        f"hidden size {hidden:,} < {LEAN_RECOMPUTE_MIN_HIDDEN:,}: launch-bound, the row tiles cost more",
    )


def lean_under_graphs(prepared: PreparedModel, setting) -> None:
    """The run's micro-batches replay CUDA graphs: take the lean recompute's auto choice again
    with them (before any capture), in the offloader and the report."""
    if prepared.offloader is None:
        return
    lean, why = lean_recompute_choice(setting, hf_model(prepared.model), graphs=True)
    prepared.offloader.lean_recompute = lean
    prepared.report["lean_recompute"] = f"{'on' if lean else 'off'}: {why}"


def install_offload(model, mode: str, device, keep_attention: bool = True, lean_recompute=AUTO):
    """Offloaded checkpointing on a prepared model whose checkpointing is already on (the
    session's last resort when a step runs out of memory); (the ActivationOffloader or None,
    its report line)."""
    return _install_offload(hf_model(model), mode, torch.device(device), True, keep_attention, lean_recompute)


def _install_offload(
    base, mode: str, device: torch.device, gradient_checkpointing: bool, keep_attention: bool, lean=AUTO
):
    """(the installed ActivationOffloader or None, its report line)."""
    from engine.fastpath.offload import ActivationOffloader, decoder_layers

    if mode in ("off", AUTO, None, False):
        return None, "off: disabled in config" if mode in ("off", False) else "off: not chosen"
    if not gradient_checkpointing:
        return None, "off: offload moves checkpointed layer inputs, and checkpointing is off"
    alone = documents_alone(base)
    if alone:  # one forward per document: the offloader's per-layer slots hold one
        return None, f"off: {base.config.model_type} runs each document alone ({alone})"
    layers = decoder_layers(base)
    if not layers:
        return None, f"off: {type(base).__name__} has no checkpointed decoder layers"
    lean = lean_recompute_choice(lean, base)[0]
    offloader = ActivationOffloader(
        mode, device, keep_attention_allowed=keep_attention, lean_recompute=lean, keep_rng=draws_random(base)
    )
    offloader.install(layers)
    where = "" if device.type == "cuda" else " (CPU: the copies stay in host memory and save nothing)"
    return offloader, f"on: {mode} buffer, {len(layers)} layers{where}"


def documents_alone(base) -> Optional[str]:
    """Why each document of a packed row runs as its own forward for the transformers model `base`
    as prepared (engine.models.arch.packing), or None where packed rows keep its documents apart.
    Whether the engine's packed attention runs it is read from its config's attention
    implementation, which enable_packed_attention sets."""
    from engine.fastpath.attention import ATTN_NAME
    from engine.models.arch.packing import documents_alone as why_alone

    cfg = base.config
    packed = getattr(cfg, "_attn_implementation", None) == ATTN_NAME
    return why_alone(getattr(cfg, "model_type", None), packed_attention=packed)


def decoder_and_head(model):
    """(the transformers model, its decoder, its output head) of a plain or PEFT-wrapped model."""
    base = hf_model(model)
    decoder = base.get_decoder()
    if decoder is base:  # transformers' lookup found no decoder attribute (Llama-4's text-only LM keeps it in `model`)
        decoder = getattr(base, "model", decoder)
    return base, decoder, base.get_output_embeddings()


def decoder_hidden(model, batch: PackedBatch, cached_metadata: bool = True, offloader=None):
    """(the transformers model, the decoder's last hidden states as [tokens, hidden], the output
    head) for one packed micro-batch: the part of every objective's forward before its loss.

    `model`: the model, or the PreparedModel prepare_model returned (whose offloader is then
    used). `offloader`: the ActivationOffloader installed in the model, if any; it chooses
    each micro-batch's buffering and whether attention outputs are kept."""
    if isinstance(model, PreparedModel):
        offloader = offloader if offloader is not None else model.offloader
        model = model.model
    base, decoder, head = decoder_and_head(model)
    if offloader is not None and base.training and torch.is_grad_enabled():
        # Double buffering needs room for one more layer input, keeping attention outputs
        # room for them: both decided per micro-batch.
        from engine.fastpath.offload import attention_keep_bytes

        keep = 0
        if offloader.keep_attention_allowed:
            keep = attention_keep_bytes(batch.info.lengths, base.config, head.weight.dtype, len(offloader.slots))
        offloader.begin_step(batch.num_tokens, base.config.hidden_size, head.weight.dtype, keep)
    kwargs = batch.model_kwargs()
    if not cached_metadata:
        # Ablation: hand the layers only positions, so each rebuilds cu_seqlens itself.
        kwargs = {"input_ids": kwargs["input_ids"], "position_ids": kwargs["position_ids"]}
    from engine.fastpath.host_embed import host_embedding

    hosted = host_embedding(base)
    if hosted is not None:  # the table is in host memory: look the batch's host ids up there
        ids = kwargs.pop("input_ids")
        kwargs["inputs_embeds"] = hosted(batch.host_ids if batch.host_ids is not None else ids)
    from engine.models.arch import logit_scale

    alone = documents_alone(base)
    if alone:
        # One document too: the packed metadata alone makes some stock layers refuse the call (the
        # gated delta rule's fallback without flash-linear-attention, transformers 5.25).
        hidden = _each_document(decoder, kwargs, batch.info.lengths, f"{base.config.model_type}: {alone}")
    else:
        hidden = decoder(**kwargs, use_cache=False).last_hidden_state
    scale = logit_scale(base.config)
    if scale != 1.0:
        # Families whose stock forward scales the logits (Cohere x logit_scale, Granite / logits_scaling):
        # scaling the (bias-free) head's input gives those logits to every loss built on the head.
        hidden = hidden * scale
    return base, hidden.reshape(-1, hidden.shape[-1]), head


def _each_document(decoder, kwargs: dict, lengths: list[int], why: str) -> torch.Tensor:
    """The decoder over each document of a packed row alone, concatenated in the row's order.

    For families whose layers would let a packed document see the one before it (convolutions or
    state-space layers along the whole row, Arch.row_state) and for those nobody has checked
    (engine.models.arch.packing); each forward gets positions alone, no packed metadata. Counted per
    forward of several documents, with its reason (`why`: "<model_type>: <why>")."""
    from engine.counters import count_fallback

    if len(lengths) > 1:  # a row of one document loses nothing
        count_fallback("packed_rows", f"{why}: each document runs alone")
    key = "inputs_embeds" if "inputs_embeds" in kwargs else "input_ids"
    stream, start, parts = kwargs[key], 0, []
    for n in lengths:
        positions = torch.arange(n, device=stream.device).unsqueeze(0)
        part = stream[:, start : start + n]
        parts.append(decoder(**{key: part}, position_ids=positions, use_cache=False).last_hidden_state)
        start += n
    return torch.cat(parts, dim=1)


def forward_loss(
    model,
    batch: PackedBatch,
    normalizer: float,
    fused_ce: bool = True,
    cached_metadata: bool = True,
    ce_chunk_tokens: int | None = None,
    offloader=None,
) -> torch.Tensor:
    """sum(token losses over trained targets) / normalizer for one micro-batch (SFT's loss).

    `model`, `offloader`: as for decoder_hidden."""
    base, hidden, head = decoder_hidden(model, batch, cached_metadata, offloader)
    targets = batch.targets.reshape(-1)
    softcap = getattr(base.config, "final_logit_softcapping", None)
    from engine.fastpath.host_head import HostHead, streamed_linear_cross_entropy

    if isinstance(head, HostHead):
        # A tied table in host memory: the loss streams it (fused or not, the only way: the
        # head has no device weight to multiply by).
        return streamed_linear_cross_entropy(
            hidden, head.host_weight, targets, ignore_index=IGNORE_INDEX, softcap=softcap, normalizer=float(normalizer)
        )
    if fused_ce:
        from engine.kernels.fused_ce import fused_linear_cross_entropy

        return fused_linear_cross_entropy(
            hidden,
            head.weight,
            targets,
            bias=head.bias,
            ignore_index=IGNORE_INDEX,
            softcap=softcap,
            normalizer=float(normalizer),
            chunk_tokens=ce_chunk_tokens,
        )
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / float(normalizer)
