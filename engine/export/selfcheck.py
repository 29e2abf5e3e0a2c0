"""The self-check every export runs before it is called done.

An export is loaded in its own runtime (PEFT on the base for the adapter, plain transformers for
the merged folder, llama.cpp for a GGUF) and compared with the trained model: the run's base plus
the run's own adapter, rebuilt in memory in float32 (`Reference`). On held-out prompts rendered
through the chat template it measures

- top-1 agreement: how often the artefact's most likely next token is the reference's, over the
  tokens of the held-out answers (the part training taught); a different pick among tokens the
  reference scores within `TIE_NATS` of each other is a tie, not a disagreement (`top1_exact`
  counts those too);
- KL(reference || artefact), the mean over those tokens, in nats;
- perplexity of the held-out answers under both, and the relative change ("the drop");

and it lints what makes an exported model "never stop" or "talk gibberish" elsewhere:

- EOS is set in the tokenizer and in generation_config, and the token that ends an assistant turn
  in the template is one the runtime stops on;
- the template renders a two-turn conversation the same in the artefact as in training (for a
  GGUF: the template in its metadata, rendered by llama-cpp-python's own Jinja formatter);
- generation in the target runtime stops by itself within `STOP_WITHIN` tokens on the prompts
  where the trained model does (a trained model that never stops is the run's problem, reported
  as a note, not the export's).

The result is a `Verdict`: "verified", "verified with a drop of X", or "failed" with the reason.
The limits are the kind's own (`ExportKind.thresholds`, in its module) and stated in the verdict."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

STOP_WITHIN = 64  # new tokens a reply may take before "does not stop" (demo answers take < 10)
MAX_EXAMPLES = 12  # held-out examples scored (logits of every answer token are kept per example)
MAX_GENERATE = 4  # of which this many are also generated to the end
STATED_DROP = 0.01  # a perplexity rise above 1% is stated in the verdict ("verified with a drop of")
# Two next tokens whose reference log-probabilities are this close (nats) are a tie: rounding may
# pick either, so picking the other is not a disagreement (an under-trained model has many).
TIE_NATS = 0.05

# A second user turn for the two-turn template check.
TWO_TURNS = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "Answer: 4"},
    {"role": "user", "content": "And 3 plus 3?"},
]


@dataclass(frozen=True)
class Thresholds:
    """What an artefact must reach to pass. Computed in float32 against the float32 reference,
    so the numbers hold on any x86 CPU: 16-bit weights move logits by rounding only, and the
    quantized GGUFs' limits were set from the demo model with a wide margin (docs/ENGINE_API.md)."""

    min_top1: float  # top-1 agreement, 0..1
    max_kl: float  # mean KL(reference || artefact) per answer token, nats
    max_ppl_drop: float  # relative perplexity rise on the held-out answers
    note: str  # how the limit is worded in the verdict


# A 16-bit copy of the weights (a merged model, a GGUF in f16/bf16): a rounding of every weight.
SIXTEEN_BIT = Thresholds(0.95, 0.01, 0.02, "16-bit rounding")


@dataclass
class Lint:
    name: str
    ok: bool
    detail: str
    blocking: bool = True  # False: a note, shown but never failing the export


@dataclass
class Verdict:
    """The self-check's outcome for one artefact (what export-report.json holds per kind)."""

    kind: str
    artefact: str  # the path the artefact has once published
    status: str  # "verified" | "verified with a drop" | "failed"
    summary: str  # one line for the person: "verified", "verified with a drop of 3.1% ...", "failed: ..."
    reasons: list[str] = field(default_factory=list)  # why it failed, one sentence each
    metrics: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    lints: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replies: list[dict] = field(default_factory=list)  # prompt, reply, stopped (the generated ones)
    time: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# -- held-out examples -------------------------------------------------------------------------
@dataclass
class Probe:
    """One held-out example, tokenized by the trained tokenizer."""

    messages: list[dict]  # the conversation with its reference answer
    ids: list[int]  # the whole rendered conversation
    positions: list[int]  # t such that ids[t + 1] is an answer token: the logits scored
    prompt_ids: list[int]  # the conversation up to the assistant's turn (generation prompt added)
    prompt: str  # the user's message, for the report
    text: str = ""  # the rendered conversation `ids` tokenize (decoding ids does not give it back: SentencePiece)


def heldout_rows(cfg, limit: int) -> tuple[list, str]:
    """(messages per example, where they came from). The run's held-out file (data.eval_source)
    when it has one; the demo's held-out file for the demo data; otherwise the last rows of the
    training data, said as such."""
    from engine.data.sources import load_raw

    eval_source = getattr(cfg.data, "eval_source", "")  # a run's own held-out file, when it names one
    if eval_source:
        from dataclasses import replace

        raw = load_raw(replace(cfg.data, source=eval_source, max_examples=0))
        origin = f"the run's held-out file ({eval_source})"
    elif cfg.data.source == "demo":
        import datasets

        from engine.resources import DEMO_HELDOUT_FILE

        datasets.disable_progress_bars()
        raw = datasets.load_dataset("json", data_files=str(DEMO_HELDOUT_FILE), split="train")
        origin = f"the demo's held-out set ({DEMO_HELDOUT_FILE.name})"
    else:
        raw = load_raw(cfg.data)
        raw = raw.select(range(max(0, len(raw) - limit), len(raw)))
        origin = f"the last {min(limit, len(raw))} rows of the training data (the run has no held-out set)"
    to_example = _reader(cfg, list(raw.column_names))
    out = []
    for row in raw:
        try:
            example = to_example(row)
        except ValueError:
            continue  # a row training would skip as well
        out.append(example)
        if len(out) >= limit:
            break
    return out, origin


def _reader(cfg, columns: list[str]):
    """row -> example, as the run's method reads its data: SFT's formats, or the preference kind of
    DPO, ORPO, SimPO, KTO and GRPO (engine.data.preference.reference_example)."""
    from engine.data.formats import detect_format, row_to_messages
    from engine.data.preference import detect_preference_format, reference_example
    from engine.data.preview import METHOD_DATA

    kind = METHOD_DATA.get(str(getattr(cfg.training, "method", "sft")).lower())
    if kind is not None:
        spec = detect_preference_format(columns, kind, cfg.data.columns, cfg.data.source)
        return lambda row: reference_example(row, spec)
    spec = detect_format(columns, cfg.data.format, cfg.data.columns)
    return lambda row: row_to_messages(row, spec)


def make_probes(tokenizer, examples: list, data=None) -> list[Probe]:
    """The examples as training renders them (`data`, the run's DataConfig: its
    fold_system_message, earlier_reasoning and thinking); a row the template rejects is left out, as
    training leaves it out."""
    from engine.data.render import render, tokenize_example

    fold = bool(getattr(data, "fold_system_message", False))
    earlier = getattr(data, "earlier_reasoning", "drop") or "drop"
    thinking = getattr(data, "thinking", None)  # as the run recorded it ("auto": the template's default)
    probes = []
    for ex in examples:
        try:
            tok = tokenize_example(tokenizer, ex, True, fold, earlier, thinking)
        except ValueError:
            continue  # a row training would skip as well
        positions = [t for t in range(len(tok.ids) - 1) if tok.trained[t + 1]]
        if not positions:
            continue
        if isinstance(ex, str):  # a text row: score everything, generate from its first half
            prompt_ids, prompt = tok.ids[: max(1, len(tok.ids) // 2)], ex[:60]
            text = ex + (tokenizer.eos_token or "")
        else:
            last_user = max(i for i, m in enumerate(ex) if m["role"] != "assistant")
            head = ex[: last_user + 1]
            head_text, _, _ = render(tokenizer, head, fold, generation_prompt=True, thinking=thinking)
            prompt_ids = list(tokenizer(head_text, add_special_tokens=False)["input_ids"])
            prompt = head[-1]["content"]
            text = tok.text or render(tokenizer, ex, fold, thinking=thinking)[0]
        probes.append(Probe(ex if not isinstance(ex, str) else [], tok.ids, positions, prompt_ids, prompt, text))
    return probes


# -- comparing logits --------------------------------------------------------------------------
def compare(ref: list, art: list, probes: list[Probe]) -> dict:
    """Top-1 agreement, mean KL(ref || art) and both perplexities over every probe's answer tokens.
    `ref` / `art`: per probe, log-probabilities [positions, vocab] (torch float32)."""
    import torch

    agree = raw = kl = nll_ref = nll_art = 0.0
    count = 0
    for r, a, p in zip(ref, art, probes):
        v = min(r.shape[-1], a.shape[-1])  # a padded vocabulary has more rows that never win
        r, a = r[:, :v].double(), a[:, :v].double()
        targets = torch.tensor([p.ids[t + 1] for t in p.positions])
        ref_top, art_top = r.argmax(-1), a.argmax(-1)
        raw += float((ref_top == art_top).sum())
        gap = r.gather(1, ref_top[:, None]) - r.gather(1, art_top[:, None])
        agree += float((gap[:, 0] <= TIE_NATS).sum())
        kl += float((r.exp() * (r - a)).sum())
        nll_ref -= float(r.gather(1, targets[:, None]).sum())
        nll_art -= float(a.gather(1, targets[:, None]).sum())
        count += len(p.positions)
    count = max(count, 1)
    ppl_ref, ppl_art = math.exp(nll_ref / count), math.exp(nll_art / count)
    return {
        "tokens": count,
        "top1_agreement": agree / count,  # ties (TIE_NATS) count as agreeing
        "top1_exact": raw / count,
        "kl": max(kl / count, 0.0),
        "ppl_reference": ppl_ref,
        "ppl_artefact": ppl_art,
        "ppl_drop": ppl_art / ppl_ref - 1.0,
    }


# -- runtimes ----------------------------------------------------------------------------------
class HFRuntime:
    """A transformers model (plain, or PEFT on the base) as the self-check drives it."""

    def __init__(self, model, eos_ids: set[int], pad_id: Optional[int]):
        self.model = model.eval()
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    def logprobs(self, probe: Probe):
        import torch

        with torch.no_grad():
            ids = torch.tensor([probe.ids], device=self.model.device)
            logits = self.model(input_ids=ids).logits[0, probe.positions].float().cpu()
        return torch.log_softmax(logits, -1)

    def generate(self, prompt_ids: list[int], max_new: int) -> tuple[list[int], bool]:
        """Greedy reply with the model's own generation_config (what its runtime stops on)."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([prompt_ids], device=self.model.device)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad_id,
            )
        new = out[0, len(prompt_ids) :].tolist()
        stopped = bool(new) and new[-1] in self.eos_ids
        if stopped:
            new = new[:-1]
        return new, stopped


def generation_eos(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# -- the reference -----------------------------------------------------------------------------
@contextlib.contextmanager
def strict_adapter_load(where):
    """PEFT only warns when an adapter's weights match no module of the model ("missing adapter
    keys"), and the model then runs as the plain base: for a check that is a failure."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    missing = [w for w in caught if "missing adapter keys" in str(w.message)]
    if missing:
        keys = str(missing[0].message).count("lora_")
        raise RuntimeError(
            f"{keys} LoRA weights of the model found nothing to load in {where}: PEFT matched none of "
            "the adapter's names for them (an adapter of another base model, or names that transformers "
            "renames on loading for this family)"
        )


def trained_tokenizer(source):
    """The tokenizer the run trained with: the one saved beside its adapter (it carries the chat
    template training used), else the base model's."""
    from engine.data.render import ensure_chat_template
    from engine.models.loading import load_tokenizer

    tok = None
    if any((source.adapter / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(source.adapter))
        except (OSError, ValueError):
            tok = None
    if tok is None:
        tok = load_tokenizer(source.config().model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ensure_chat_template(tok)
    return tok


def check_device() -> tuple[str, str]:
    """(device, dtype) of the check. float32 on the CPU, so the numbers are the weights' and not
    the CPU's half-precision arithmetic; bf16 on a GPU (a float32 copy of a large model would not
    fit), where the thresholds still hold because both sides run the same arithmetic."""
    import torch

    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


class Reference:
    """The trained model rebuilt from the run (base + the run's adapter), its scores on the
    held-out probes and its greedy replies, computed once per export flow and shared by the kinds."""

    def __init__(self, source, progress: Optional[Callable[[str], None]] = None):
        self.source = source
        self.progress = progress
        self._model = None
        self.tokenizer = None
        self.probes: list[Probe] = []
        self.logprobs: list = []
        self.replies: list[tuple[list[int], bool]] = []
        self.origin = ""
        self.built = False

    def say(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    def base(self):
        from engine.models.loading import load_model

        cfg = self.source.config().model
        cfg.load_in_4bit = False  # compare against full-precision base weights
        device, dtype = check_device()
        return load_model(cfg, device, dtype)

    def model(self):
        """The PEFT model (base + the run's adapter under the name "default")."""
        if self._model is None:
            from peft import PeftModel

            from engine.models.loading import quiet_third_party
            from engine.models.lora import keep_lora_targets

            self.say("self-check: loading the trained model (base + the run's adapter)")
            with quiet_third_party(), keep_lora_targets(), strict_adapter_load(self.source.adapter):
                self._model = PeftModel.from_pretrained(self.base(), str(self.source.adapter)).eval()
        return self._model

    def release(self) -> None:
        self._model = None
        import gc

        gc.collect()

    def build(self) -> "Reference":
        if self.built:
            return self
        self.tokenizer = trained_tokenizer(self.source)
        config = self.source.config()
        examples, self.origin = heldout_rows(config, MAX_EXAMPLES)
        self.probes = make_probes(self.tokenizer, examples, config.data)
        if not self.probes:
            raise RuntimeError(f"no held-out example to check with in {self.origin}")
        model = self.model()
        rt = HFRuntime(model, self.eos_ids(), self.tokenizer.pad_token_id)
        self.say(f"self-check: scoring {len(self.probes)} held-out examples with the trained model")
        self.logprobs = [rt.logprobs(p) for p in self.probes]
        self.replies = [rt.generate(p.prompt_ids, STOP_WITHIN) for p in self.probes[:MAX_GENERATE]]
        self.built = True
        return self

    def eos_ids(self) -> set[int]:
        ids = generation_eos(self.model()) if self._model is not None else set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def two_turns(self) -> str:
        return self.tokenizer.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


# -- lints shared by the kinds -----------------------------------------------------------------
def turn_end_token(tokenizer) -> Optional[int]:
    """The token right after an assistant message's content in the template (<|im_end|>,
    <|eot_id|>, </s> ...), when it is a special token; None when the template ends turns with text.
    A template that leaves it off the last answer (GLM's <|user|>) gives the one training puts there
    (engine.data.render.render_closed), so the export stops where the model learned to."""
    from engine.data.render import render_closed

    marker = "\x01TUNESMITH\x01"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    try:
        text = render_closed(tokenizer, msgs)
    except Exception:  # templates may refuse odd conversations; then there is nothing to check
        return None
    tail = text.split(marker, 1)[-1] if marker in text else ""
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    return ids[0] if ids[0] in special else None


def lint_eos(tokenizer, gen_eos: set[int], where: str) -> list[Lint]:
    """EOS in the tokenizer and in generation_config, and the turn-ending token among them."""
    out = []
    eos = tokenizer.eos_token_id
    if eos is None:
        out.append(Lint("eos", False, f"the tokenizer in {where} has no EOS token: generation never stops"))
    elif not gen_eos:
        out.append(Lint("eos", False, f"generation_config in {where} sets no eos_token_id: generation never stops"))
    elif eos not in gen_eos:
        out.append(
            Lint(
                "eos",
                False,
                f"the tokenizer's EOS {tokenizer.eos_token!r} (id {eos}) is not in generation_config's "
                f"eos_token_id {sorted(gen_eos)}",
            )
        )
    else:
        out.append(Lint("eos", True, f"EOS {tokenizer.eos_token!r} (id {eos}) in the tokenizer and generation_config"))
    end = turn_end_token(tokenizer)
    if end is not None:
        name = tokenizer.convert_ids_to_tokens(end)
        ok = end in gen_eos
        detail = (
            f"the template ends a turn with {name!r}, which generation stops on"
            if ok
            else f"the template ends a turn with {name!r} (id {end}), which is not an EOS in generation_config: "
            "replies run on past the answer"
        )
        out.append(Lint("turn end", ok, detail))
    return out


def lint_stops(replies: list[tuple[str, bool]], ref: Reference, runtime: str) -> list[Lint]:
    """The artefact stops by itself where the trained model does."""
    ref_stops = [s for _, s in ref.replies]
    broken = [i for i, (_, s) in enumerate(replies) if ref_stops[i] and not s]
    if broken:
        p = ref.probes[broken[0]].prompt
        return [
            Lint(
                "stops",
                False,
                f"{runtime} does not stop within {STOP_WITHIN} tokens on {len(broken)} of {len(replies)} prompts "
                f"where the trained model does (e.g. {p!r})",
            )
        ]
    lints = [Lint("stops", True, f"{runtime} stops by itself within {STOP_WITHIN} tokens where the trained model does")]
    if not all(ref_stops):
        n = ref_stops.count(False)
        lints.append(
            Lint(
                "trained model stops",
                False,
                f"the trained model itself does not stop within {STOP_WITHIN} tokens on {n} of {len(ref_stops)} "
                "prompts (train longer); not an export problem",
                blocking=False,
            )
        )
    return lints


# -- the verdict -------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def verdict(
    kind: str,
    artefact: Path,
    limits: Thresholds,
    metrics: dict,
    lints: list[Lint],
    replies: list[dict],
    ref: Reference,
) -> Verdict:
    reasons = [lint.detail for lint in lints if lint.blocking and not lint.ok]
    if metrics:
        if metrics["top1_agreement"] < limits.min_top1:
            reasons.append(
                f"top-1 agreement with the trained model is {_pct(metrics['top1_agreement'])}, "
                f"below {_pct(limits.min_top1)} ({limits.note})"
            )
        if metrics["kl"] > limits.max_kl:
            reasons.append(
                f"KL divergence from the trained model is {metrics['kl']:.4f} nats/token, above {limits.max_kl}"
            )
        if metrics["ppl_drop"] > limits.max_ppl_drop:
            reasons.append(
                f"perplexity on the held-out answers rose {_pct(metrics['ppl_drop'])} "
                f"({metrics['ppl_reference']:.3f} to {metrics['ppl_artefact']:.3f}), above {_pct(limits.max_ppl_drop)}"
            )
    if reasons:
        status, summary = "failed", "failed: " + reasons[0]
    elif metrics and (metrics["ppl_drop"] > STATED_DROP or metrics["top1_agreement"] < 0.99):
        # Beyond rounding: perplexity moved, or the top token changed where it was not a tie.
        status = "verified with a drop"
        if metrics["ppl_drop"] > STATED_DROP:
            drop = f"{_pct(metrics['ppl_drop'])} in held-out perplexity"
            other = f"top-1 agreement {_pct(metrics['top1_agreement'])}"
        else:
            drop = f"{_pct(1 - metrics['top1_agreement'])} in top-1 agreement"
            other = f"held-out perplexity {metrics['ppl_drop'] * 100:+.1f}%"
        summary = f"verified with a drop of {drop} ({other}; allowed: {limits.note})"
    else:
        status, summary = "verified", "verified: behaves like the trained model"
    return Verdict(
        kind=kind,
        artefact=str(artefact),
        status=status,
        summary=summary,
        reasons=reasons,
        metrics={**metrics, "examples": len(ref.probes), "examples_from": ref.origin},
        thresholds=asdict(limits),
        lints=[asdict(lint) for lint in lints],
        notes=[lint.detail for lint in lints if not lint.blocking and not lint.ok],
        replies=replies,
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def failed(kind: str, artefact: Path, reason: str) -> Verdict:
    """A verdict for an artefact that could not even be loaded or compared."""
    return Verdict(
        kind=kind,
        artefact=str(artefact),
        status="failed",
        summary="failed: " + reason,
        reasons=[reason],
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def check_hf(
    kind: str,
    runtime: HFRuntime,
    tokenizer,
    gen_eos: set[int],
    ref: Reference,
    artefact: Path,
    where: str,
    thresholds: Thresholds,
    eos_blocking: bool = True,
):
    """The comparison and lints for a transformers-loaded artefact (adapter or merged), against
    the kind's `thresholds`.
    `eos_blocking` False: the EOS lints are notes (an adapter cannot carry the base's
    generation_config, so a base that lacks the turn-end token is said, not failed)."""
    lints = lint_eos(tokenizer, gen_eos, where)
    for lint in lints:
        lint.blocking = eos_blocking or lint.ok
    template = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)
    same = template == ref.two_turns()
    lints.append(
        Lint(
            "template",
            same,
            "the chat template renders a two-turn conversation as in training"
            if same
            else f"the chat template in {where} renders a two-turn conversation differently from training",
        )
    )
    metrics = compare(ref.logprobs, [runtime.logprobs(p) for p in ref.probes], ref.probes)
    replies, out = [], []
    for p in ref.probes[:MAX_GENERATE]:
        ids, stopped = runtime.generate(p.prompt_ids, STOP_WITHIN)
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        replies.append((text, stopped))
        out.append({"prompt": p.prompt, "reply": text, "stopped": stopped})
    lints += lint_stops(replies, ref, "generation with transformers")
    same_replies = sum(r == ref.decode(i) for (r, _), (i, _) in zip(replies, ref.replies))
    metrics["same_replies"] = f"{same_replies}/{len(replies)}"
    return verdict(kind, artefact, thresholds, metrics, lints, out, ref)
