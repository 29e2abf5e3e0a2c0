"""Preference and prompt data: DPO/ORPO/SimPO pairs, KTO's unpaired answers, GRPO's prompts.

Shapes detected (names case-insensitive; `data.columns` maps prompt/chosen/rejected/completion/
label onto other column names):

- paired: prompt / chosen / rejected, each text or a list of messages. TRL's conversational
  format is the messages case (prompt: the conversation so far; chosen, rejected: the
  assistant's turn). Without a prompt column, chosen and rejected are whole conversations and
  the prompt is their shared beginning (TRL's implicit prompt).
- unpaired (KTO): prompt / completion / label (true: desirable).
- prompts (GRPO): a prompt column (text or messages); every other column is kept for the
  reward functions (an `answer` column for exact match, say).

Text prompts are rendered as a user turn and answers as the assistant's, through the tokenizer's
chat template (the ChatML fallback for a base model), as SFT renders instruction rows. The answer
tokens are what the full conversation adds to the prompt's rendering (with the generation
prompt): they end with the template's end-of-turn marker, so the model learns to stop.

A pair whose two sides do not fit one packed row together is truncated (answers cut at the end)
or dropped, per `data.overlong`; a prompt that alone fills the row is skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.data import plural, shown_row
from engine.data.formats import ROLE_NAMES, FormatSpec, carries_reasoning, message_reasoning
from engine.data.packing import PackingResult, pack_best_fit_decreasing
from engine.data.render import ensure_chat_template, render, render_closed
from engine.data.sources import DataError, load_raw

ALIASES = {
    "prompt": ["prompt", "question", "instruction", "query"],
    "chosen": ["chosen", "preferred", "accepted"],
    "rejected": ["rejected", "dispreferred"],
    "completion": ["completion", "response", "output", "answer"],
    "label": ["label", "desirable", "kto_label"],
}
KINDS = ("paired", "unpaired", "prompts")


@dataclass
class PreferenceSpec:
    kind: str  # "paired" | "unpaired" | "prompts"
    mapping: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.kind} ({', '.join(f'{k} <- {v}' for k, v in self.mapping.items())})"


def detect_preference_format(columns: list[str], kind: str, mapping: Optional[dict] = None, source: str = ""):
    """The spec for `kind` ("paired", "unpaired" or "prompts"), or a DataError naming the file,
    its columns and the columns to map."""
    mapping = dict(mapping or {})
    lower = {c.lower(): c for c in columns}
    for key, col in mapping.items():
        if key not in ALIASES:
            raise DataError(f"data.columns.{key}: unknown field for preference data; use {', '.join(ALIASES)}")
        if col not in columns:
            raise DataError(f"data.columns.{key}: column '{col}' is not in the data (columns: {', '.join(columns)})")

    def find(key):
        if key in mapping:
            return mapping[key]
        return next((lower[a] for a in ALIASES[key] if a in lower), None)

    need = {"paired": ["chosen", "rejected"], "unpaired": ["prompt", "completion", "label"], "prompts": ["prompt"]}[
        kind
    ]
    found = {k: find(k) for k in ALIASES}
    missing = [k for k in need if not found[k]]
    if missing:
        where = f"{source}: " if source else ""
        keys = ", ".join(f"{k}: COLUMN" for k in missing)
        raise DataError(
            f"{where}the columns {', '.join(columns) or '(none)'} have no {' / '.join(missing)} column for "
            f"{kind} data; map them (in the window's Data page, or in the config: data.columns: {{{keys}}})"
        )
    keys = need + (["prompt"] if kind == "paired" and found["prompt"] else [])
    return PreferenceSpec(kind, {k: found[k] for k in keys})


def _messages(value, what: str, role: str) -> list[dict]:
    """Text -> one turn of `role`; a list of messages -> normalised messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{what} is empty")
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} is neither text nor a non-empty list of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{what}: message {i} is not an object")
        r = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if msg.get("tool_calls") or msg.get("function_call"):  # dropped, the pair would compare other answers
            raise ValueError(f"{what}: message {i} calls a tool, which preference pairs do not take (SFT rows do)")
        if r not in ROLE_NAMES or not isinstance(content, str):
            raise ValueError(f"{what}: message {i} has role {r!r} and content of type {type(content).__name__}")
        message = {"role": ROLE_NAMES[r], "content": content}
        try:  # an answer's reasoning in a field of its own, as in SFT data (engine.data.formats)
            message.update(message_reasoning(msg, i, message))
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        out.append(message)
    return out


def reference_example(row: dict, spec: PreferenceSpec):
    """A row of preference data as one example that other readers (the export's self-check)
    score: a pair's prompt with its chosen answer, a KTO row's prompt with its completion, and a
    GRPO prompt (no answer to score) as its text. ValueError for a row training would skip."""
    m = spec.mapping
    if spec.kind == "prompts":
        prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
        return "\n".join(msg["content"] for msg in prompt)
    if spec.kind == "unpaired":
        prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
        return prompt + _messages(row.get(m["completion"]), f"column '{m['completion']}'", "assistant")
    chosen = _messages(row.get(m["chosen"]), f"column '{m['chosen']}'", "assistant")
    if "prompt" not in m:
        return chosen  # the implicit-prompt format: the chosen conversation holds its prompt
    return _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user") + chosen


def _ids(tokenizer, messages, generation_prompt=False, fold_system=False, thinking=None) -> list[int]:
    """The conversation's tokens through the one render (engine.data.render): a template that
    rejects the row gives a RowError (a ValueError: the row is skipped with its reason), and
    data.fold_system_message folds a system message the template has no turn for, as for SFT."""
    text, _, _ = render(tokenizer, messages, fold_system, generation_prompt, thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _answer_ids(tokenizer, prompt_msgs, prompt_ids, answer_msgs, fold_system=False, thinking=None) -> list[int]:
    # With the end-of-turn token a template leaves off the last answer (GLM's <|user|>), as SFT has it.
    full = list(
        tokenizer(render_closed(tokenizer, prompt_msgs + answer_msgs, fold_system, thinking), add_special_tokens=False)[
            "input_ids"
        ]
    )
    n = 0
    while n < min(len(full), len(prompt_ids)) and full[n] == prompt_ids[n]:
        n += 1
    if n < len(prompt_ids):
        raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
    if len(full) == n:
        raise ValueError("the answer renders to no tokens")
    return full[n:]


def _shared_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """TRL's implicit prompt: the messages chosen and rejected share, then each one's rest."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError("chosen and rejected share no prompt (add a prompt column)")
    return chosen[:n], chosen[n:], rejected[n:]


@dataclass
class PreferenceData:
    """Tokenized examples of one kind, packed one example per document group.

    paired: `examples[i]` = (prompt, chosen, rejected) ids; unpaired: (prompt, completion,
    kl_completion) with `labels[i]`; prompts: (prompt,) with `rows[i]` the row's columns.
    `docs[i]`: the example's tokens as the packed row holds them (its size for the step plan)."""

    kind: str
    examples: list[tuple]
    docs: list[list[int]]
    packing: PackingResult
    spec: PreferenceSpec
    num_rows: int
    labels: list[bool] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    row_ids: list[int] = field(default_factory=list)  # the data row of each example
    skipped: list[tuple[int, str]] = field(default_factory=list)
    truncated: int = 0
    used_fallback_template: bool = False
    notes: list[str] = field(default_factory=list)  # sentences the run log says once
    thinking: Optional[bool] = None  # the template's thinking switch (data.thinking resolved)

    def summary(self) -> dict:
        return {
            "rows_read": self.num_rows,
            "examples": len(self.examples),
            "skipped": len(self.skipped),
            "truncated": self.truncated,
            "format": self.spec.describe(),
            "packed_rows": len(self.packing.rows),
            "row_tokens": self.packing.row_tokens,
            "tokens": self.packing.total_tokens,
            "packing_efficiency": round(self.packing.efficiency, 4),
        }


def _fit(prompt, answers, limit, overlong):
    """Cut the answers' ends so prompt + every answer fit `limit` tokens; None: drop."""
    total = len(answers) * len(prompt) + sum(map(len, answers))
    if total <= limit:
        return answers, False
    if overlong == "drop":
        return None, False
    room = (limit - len(answers) * len(prompt)) // len(answers)
    if room < 1:
        return None, False
    return [a[:room] for a in answers], True


def preference_thinking(setting, raw, spec: PreferenceSpec) -> bool | None:
    """data.thinking for preference data, as formats.data_thinking for SFT: "auto" is on when an
    answer (chosen, rejected or completion) carries its reasoning in a field, else None."""
    if isinstance(setting, bool):
        return setting
    answers = [spec.mapping[k] for k in ("chosen", "rejected", "completion") if k in spec.mapping]
    found = any(carries_reasoning(raw, FormatSpec("conversations", {"messages": c})) for c in answers)
    return True if found else None


def prepare_preference_data(cfg, tokenizer, kind: str, extra_tokens: int = 0, raw=None) -> PreferenceData:
    """Read, detect, render and tokenize `kind` data per DataConfig `cfg`, then pack.

    paired and unpaired: a packed row of `cfg.max_seq_len` tokens holds whole examples (a pair's
    two sides, or an answer and its KL twin). prompts: one prompt per row, sized for
    `extra_tokens` (the generated groups) beyond the prompt."""
    raw = load_raw(cfg) if raw is None else raw
    columns = list(raw.column_names)
    spec = detect_preference_format(columns, kind, cfg.columns, cfg.source)
    fallback = ensure_chat_template(tokenizer)
    m = spec.mapping
    limit = cfg.max_seq_len
    fold = bool(getattr(cfg, "fold_system_message", False))
    thinking = preference_thinking(getattr(cfg, "thinking", "auto"), raw, spec)
    examples, docs, labels, rows, row_ids, skipped = [], [], [], [], [], []
    truncated = 0
    for i, row in enumerate(raw):
        try:
            if kind == "paired":
                if "prompt" in m:
                    prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
                    chosen = _messages(row.get(m["chosen"]), f"column '{m['chosen']}'", "assistant")
                    rejected = _messages(row.get(m["rejected"]), f"column '{m['rejected']}'", "assistant")
                else:
                    prompt, chosen, rejected = _shared_prompt(
                        _messages(row.get(m["chosen"]), f"column '{m['chosen']}'", "assistant"),
                        _messages(row.get(m["rejected"]), f"column '{m['rejected']}'", "assistant"),
                    )
                p = _ids(tokenizer, prompt, True, fold, thinking)
                c = _answer_ids(tokenizer, prompt, p, chosen, fold, thinking)
                r = _answer_ids(tokenizer, prompt, p, rejected, fold, thinking)
                if c == r:
                    raise ValueError("chosen and rejected are the same answer (nothing to prefer)")
                answers, cut = _fit(p, [c, r], limit, cfg.overlong)
                if answers is None:
                    raise ValueError(
                        f"prompt and both answers take {2 * len(p) + len(c) + len(r)} tokens, "
                        f"more than a row's {limit}; dropped"
                    )
                truncated += cut
                examples.append((p, *answers))
                docs.append(p + answers[0] + p + answers[1])
            elif kind == "unpaired":
                prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
                answer = _messages(row.get(m["completion"]), f"column '{m['completion']}'", "assistant")
                label = row.get(m["label"])
                if not isinstance(label, bool) and label not in (0, 1):
                    raise ValueError(f"column '{m['label']}' is {label!r}, not true/false")
                p = _ids(tokenizer, prompt, True, fold, thinking)
                c = _answer_ids(tokenizer, prompt, p, answer, fold, thinking)
                examples.append((p, c))
                labels.append(bool(label))
            else:
                prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
                p = _ids(tokenizer, prompt, True, fold, thinking)
                if len(p) >= limit:
                    raise ValueError(f"the prompt takes {len(p)} tokens, more than a row's {limit}")
                examples.append((p,))
                docs.append(p)
                rows.append({k: v for k, v in row.items()})
        except ValueError as exc:
            skipped.append((i, str(exc)))
            continue
        row_ids.append(i)
    if kind == "unpaired":
        # KTO's KL estimate pairs each prompt with the previous example's completion (TRL's).
        examples, labels, row_ids, docs, truncated = _kl_twins(examples, labels, row_ids, skipped, limit, cfg.overlong)
    if not examples:
        first = f"; first problem: row {shown_row(skipped[0][0])}: {skipped[0][1]}" if skipped else ""
        raise DataError(f"{cfg.source}: no usable {kind} examples out of {plural(len(raw), 'row')}{first}")
    if kind == "prompts":
        packing = PackingResult(
            [[i] for i in range(len(examples))], max(map(len, docs)) + extra_tokens, sum(map(len, docs))
        )
    else:
        packing = pack_best_fit_decreasing([len(d) for d in docs], limit)
    data = PreferenceData(
        kind, examples, docs, packing, spec, len(raw), labels, rows, row_ids, skipped, truncated, fallback
    )
    data.thinking = thinking
    return data


def _kl_twins(examples, labels, row_ids, skipped, limit, overlong):
    out, lab, ids, docs = [], [], [], []
    truncated = 0
    n = len(examples)
    for j, (p, c) in enumerate(examples):
        kl = examples[j - 1][1] if n > 1 else c
        answers, cut = _fit(p, [c, kl], limit, overlong)
        if answers is None:
            skipped.append(
                (
                    row_ids[j],
                    f"prompt and answer take {2 * len(p) + len(c) + len(kl)} tokens with the KL twin (the "
                    f"prompt twice, its answer and the previous row's), more than a row's {limit}; dropped",
                )
            )
            continue
        truncated += cut
        out.append((p, answers[0], answers[1]))
        lab.append(labels[j])
        ids.append(row_ids[j])
        docs.append(p + answers[0] + p + answers[1])
    return out, lab, ids, docs, truncated


def pair_findings(cfg, tokenizer, raw, spec: PreferenceSpec):
    """The X-ray of paired preference rows (engine.data.xray calls it when the columns are a
    pair format): (each readable row's tokens as its packed document holds them, before any cut:
    prompt + chosen + prompt + rejected; [(kind, row, detail)]). The kinds:

    - empty_side: the chosen or the rejected answer is empty (training skips the row);
    - identical_sides: both answers render to the same tokens (nothing to prefer; skipped);
    - side_truncated: prompt and both answers exceed max_seq_len, so a side is cut (or, with
      data.overlong: drop, the pair dropped) and its end is not what was preferred;
    - prompt_differs: the conversations before the two answers differ (the pair compares answers
      to different prompts; the implicit-prompt format trains the shared part only);
    - unreadable: anything else that stops the row (the sentence training would give)."""
    ensure_chat_template(tokenizer)
    m, limit = spec.mapping, cfg.max_seq_len
    fold = bool(getattr(cfg, "fold_system_message", False))
    thinking = preference_thinking(getattr(cfg, "thinking", "auto"), raw, spec)
    lengths, findings = [], []
    for i, row in enumerate(raw):
        sides = {}
        for side in ("chosen", "rejected"):
            value = row.get(m[side])
            if value is None or (
                isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)
            ):
                findings.append(("empty_side", i, f"the {side} answer (column '{m[side]}') is empty"))
                continue
            if isinstance(value, list) and value and isinstance(value[-1], dict):
                last = value[-1].get("content", value[-1].get("value"))
                if isinstance(last, str) and not last.strip():
                    findings.append(("empty_side", i, f"the {side} answer (column '{m[side]}') is empty"))
                    continue
            sides[side] = value
        if len(sides) < 2:
            continue
        differs = False
        try:
            chosen = _messages(sides["chosen"], f"column '{m['chosen']}'", "assistant")
            rejected = _messages(sides["rejected"], f"column '{m['rejected']}'", "assistant")
            differs = chosen[:-1] != rejected[:-1]
            if differs:
                k = next(
                    (j for j, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected))
                )
                findings.append(("prompt_differs", i, f"chosen and rejected differ before their answers (message {k})"))
            if "prompt" in m:
                prompt = _messages(row.get(m["prompt"]), f"column '{m['prompt']}'", "user")
            else:
                prompt, chosen, rejected = _shared_prompt(chosen, rejected)
            p = _ids(tokenizer, prompt, True, fold, thinking)
            c = _answer_ids(tokenizer, prompt, p, chosen, fold, thinking)
            r = _answer_ids(tokenizer, prompt, p, rejected, fold, thinking)
        except ValueError as exc:
            if not (differs and "share no prompt" in str(exc)):  # said above: the prompts differ
                findings.append(("unreadable", i, str(exc)))
            continue
        lengths.append(2 * len(p) + len(c) + len(r))
        if c == r:
            findings.append(("identical_sides", i, "chosen and rejected are the same answer (nothing to prefer)"))
        answers, cut = _fit(p, [c, r], limit, cfg.overlong)
        if answers is None:
            findings.append(
                ("side_truncated", i, f"prompt and both answers take {lengths[-1]} tokens, more than {limit}; dropped")
            )
        elif cut:
            what = [
                f"{side} keeps {len(a)} of {len(full)} tokens"
                for side, a, full in (("chosen", answers[0], c), ("rejected", answers[1], r))
                if len(a) < len(full)
            ]
            findings.append(("side_truncated", i, f"{'; '.join(what)} (max_seq_len {limit})"))
    return lengths, findings
