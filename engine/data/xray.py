"""Data X-ray: the rows of a data set a person would want to know about before training on it.

`xray(cfg, tokenizer)` reads the rows once, renders and tokenizes them exactly as training does
(engine.data.render), and reports, each with the row numbers (0-based, as the Data page shows them):

- truncated answers: the row is longer than ``max_seq_len`` and the cut falls inside trained
  (answer) tokens, so the model learns a reply that stops mid-way;
- missing end of turn: the last trained token is not a special token (EOS or the template's
  end-of-turn marker), so the model never learns to stop; a tokenizer without EOS makes every
  text row lack it;
- roles out of order or unknown: a conversation that opens with the assistant, has two turns of
  the same role in a row, ends with a user turn (nothing after it is trained), or names a role
  the formats do not know;
- fully masked prompts: nothing in the row is trained (no answer, or the cut removed it);
- special tokens typed into the text: strings such as ``<|im_end|>`` or ``</s>`` inside a message,
  which the tokenizer turns into control tokens;
- exact duplicates: rows whose rendered text is identical to an earlier row's;
- rejected by the template: the chat template raises on the row (a system message it does not
  support, roles that do not alternate); training drops the row with this reason;
- answer not ended: an earlier answer's rendered span does not end at an end-of-turn token (the
  template writes nothing, or something else, right after it; the last answer is missing_eos');
- reasoning dropped: the template renders earlier answers without their <think> reasoning
  (data.earlier_reasoning decides what is trained).

Preference pairs (chosen and rejected columns, with or without a prompt column) get their own
findings instead (engine.data.preference.pair_findings): identical chosen and rejected, an empty
side, a side truncated by ``max_seq_len``, a prompt that differs between the two sides.

It also gives the token length of every row (before truncation) for a histogram against
``max_seq_len``. It never raises for a bad row: a row that cannot be read is a finding.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from dataclasses import dataclass, field
from typing import Sequence

from engine.config import DataConfig
from engine.data import shown_row
from engine.data.formats import ROLE_NAMES, data_thinking, detect_format, row_to_messages
from engine.data.render import RowError, ensure_chat_template, tokenize_examples
from engine.data.sources import load_raw

# Finding kinds, in the order the Data page lists them, with the sentence that explains each.
KINDS = {
    "truncated_answer": "answer cut off by max_seq_len (the model learns a reply that stops mid-way)",
    "missing_eos": "no end-of-turn token after the answer (the model may never stop)",
    "roles": "turns out of order or an unknown role",
    "fully_masked": "nothing in the row is trained (no answer tokens)",
    "special_tokens": "special tokens typed into the text",
    "duplicate": "exact duplicate of an earlier row",
    "unreadable": "row cannot be read",
    "rejected": "the chat template rejects the row (training drops it)",
    "answer_end": "an answer's rendered span does not end at an end-of-turn token",
    "reasoning_dropped": "the template drops earlier answers' reasoning (see data.earlier_reasoning)",
    # Preference pairs (prompt / chosen / rejected; engine.data.preference.pair_findings).
    "identical_sides": "chosen and rejected are the same answer (nothing to prefer)",
    "empty_side": "the chosen or the rejected answer is empty",
    "side_truncated": "a side cut by max_seq_len (the pair compares cut answers)",
    "prompt_differs": "the prompt differs between the chosen and the rejected side",
}


@dataclass
class Finding:
    kind: str
    row: int
    detail: str


KEPT_PER_KIND = 1000  # findings of one kind kept with their rows; past that they are counted only


@dataclass
class XRay:
    rows: int
    max_seq_len: int
    lengths: Sequence[int]  # token length of each readable row, before truncation (array("I"): 4 bytes a row)
    findings: list[Finding] = field(default_factory=list)  # the first KEPT_PER_KIND of each kind, in row order
    more: dict[str, int] = field(default_factory=dict)  # findings of a kind past those kept
    _kept: dict[str, int] = field(default_factory=dict, repr=False, compare=False)  # add()'s count per kind

    def add(self, kind: str, row: int, detail: str) -> None:
        """Keep a finding, or (KEPT_PER_KIND of its kind are kept) count it: a file where every row
        has the same problem keeps memory bounded and still says how many rows have it."""
        kept = self._kept.get(kind, 0)
        if kept < KEPT_PER_KIND:
            self.findings.append(Finding(kind, row, detail))
            self._kept[kind] = kept + 1
        else:
            self.more[kind] = self.more.get(kind, 0) + 1

    def by_kind(self) -> dict[str, list[Finding]]:
        """The findings kept, by kind (counts() says how many there are in all)."""
        out: dict[str, list[Finding]] = {k: [] for k in KINDS}
        for f in self.findings:
            out[f.kind].append(f)
        return out

    def counts(self) -> dict[str, int]:
        return {k: len(v) + self.more.get(k, 0) for k, v in self.by_kind().items()}

    def histogram(self, bins: int = 20) -> tuple[list[int], list[int]]:
        """(bin edges, counts) over [0, max(longest, max_seq_len)]: equal-width bins."""
        top = max(self.max_seq_len, max(self.lengths)) if len(self.lengths) else self.max_seq_len
        width = max(1, -(-top // bins))
        edges = [i * width for i in range(bins + 1)]
        counts = [0] * bins
        for n in self.lengths:
            counts[min(n // width, bins - 1)] += 1
        return edges, counts

    def over_limit(self) -> int:
        return sum(n > self.max_seq_len for n in self.lengths)


def _special_strings(tokenizer) -> list[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    # Long markers first, so "<|im_end|>" is named rather than a shorter token inside it.
    return sorted((s for s in specials if len(s) > 1), key=len, reverse=True)


def _role_problem(raw_row: dict, spec) -> str | None:
    raw = raw_row.get(spec.mapping.get("messages", ""))
    if not isinstance(raw, list):
        return None
    roles = []
    for i, msg in enumerate(raw):
        role = msg.get("role", msg.get("from")) if isinstance(msg, dict) else None
        if role not in ROLE_NAMES:
            return f"message {i} has unknown role {role!r}"
        roles.append(ROLE_NAMES[role])
    turns = [r for r in roles if r != "system"]
    if turns and turns[0] == "assistant":
        return "the conversation opens with the assistant"
    for i in range(1, len(turns)):
        if turns[i] == turns[i - 1]:
            return f"two {turns[i]} turns in a row (turn {i} and {i + 1})"
    if turns and turns[-1] == "user":
        return "the conversation ends with a user turn (nothing after it is trained)"
    return None


def _texts(example) -> list[str]:
    if isinstance(example, str):
        return [example]
    # An answer's reasoning field is text the model is trained on too (formats' "reasoning").
    return [m["content"] for m in example] + [m["reasoning"] for m in example if m.get("reasoning")]


def _pair_spec(cfg: DataConfig, columns: list[str]):
    """The preference-pair spec when the columns are a pair format (chosen and rejected) and no
    supervised format (as the Data page's preview decides: engine.data.preview), else None."""
    from engine.data.preference import detect_preference_format
    from engine.data.sources import DataError

    try:
        detect_format(columns, cfg.format, cfg.columns, cfg.source)
        return None
    except DataError:
        pass
    try:
        return detect_preference_format(columns, "paired", cfg.columns, cfg.source)
    except DataError:
        return None


def _row_batches(raw):
    """(index of the first row, [rows]) in Arrow batches: engine.data.scan.Rows' own (with its
    progress and stop check) or, for a plain data set, the same batches without them."""
    from engine.data.scan import Rows

    return (raw if isinstance(raw, Rows) else Rows(raw)).batches()


def xray(cfg: DataConfig, tokenizer, raw=None) -> XRay:
    raw = load_raw(cfg) if raw is None else raw
    pairs = _pair_spec(cfg, list(raw.column_names))
    if pairs is not None:  # DPO/ORPO/SimPO data: the pairs' own findings
        from engine.data.preference import pair_findings

        lengths, found = pair_findings(cfg, tokenizer, raw, pairs)
        out = XRay(len(raw), cfg.max_seq_len, array("I", lengths))
        for f in found:
            out.add(*f)
        return out
    spec = detect_format(list(raw.column_names), cfg.format, cfg.columns, cfg.source)
    if spec.kind != "text":
        ensure_chat_template(tokenizer)
    out = XRay(len(raw), cfg.max_seq_len, array("I"))
    checks = _RowChecks(out, tokenizer, cfg)
    thinking = data_thinking(cfg.thinking, raw, spec)
    for start, batch in _row_batches(raw):
        rows = []  # (row, its roles finding or None, messages or text, or the ValueError that says why not)
        for i, row in enumerate(batch, start):
            why = _role_problem(row, spec) if spec.kind == "conversations" else None
            try:
                rows.append((i, why, row_to_messages(row, spec)))
            except ValueError as exc:
                rows.append((i, why, exc))
        readable = [example for _, _, example in rows if not isinstance(example, ValueError)]
        toks = iter(
            tokenize_examples(
                tokenizer,
                readable,
                cfg.train_on_responses_only,
                cfg.fold_system_message,
                cfg.earlier_reasoning,
                thinking,
            )
        )
        for i, why, example in rows:  # in row order, each row's findings in the order the page lists them
            if why:
                out.add("roles", i, why)
            if isinstance(example, ValueError):
                if not (spec.kind == "conversations" and "unknown role" in str(example)):  # already named above
                    out.add("unreadable", i, str(example))
                continue
            tok = next(toks)
            if isinstance(tok, RowError):
                out.add("rejected", i, str(tok))
            else:
                checks.check(i, example, tok)
    return out


class _RowChecks:
    """The findings of a rendered, tokenized row, with what they need prepared once per scan."""

    def __init__(self, out: XRay, tokenizer, cfg: DataConfig):
        self.out, self.tokenizer, self.cfg = out, tokenizer, cfg
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tok_id, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                self.special_ids.add(int(tok_id))
        self.specials = _special_strings(tokenizer)
        # One search for "any special string at all" (most rows have none); the longest-first loop
        # then names the one a row holds.
        self.any_special = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.decoded: dict[int, str] = {}  # one token's text, by id (each row's last trained token)
        # A 16-byte digest of each distinct row's messages -> its first row: about 100 bytes a row.
        self.seen: dict[bytes, int] = {}

    def piece(self, token_id: int) -> str:
        if token_id not in self.decoded:
            self.decoded[token_id] = self.tokenizer.decode([token_id])
        return self.decoded[token_id]

    def check(self, i: int, example, tok) -> None:
        out, limit = self.out, self.cfg.max_seq_len
        ids, trained = tok.ids, tok.trained
        out.lengths.append(len(ids))

        key = hashlib.blake2b(repr(example).encode("utf-8"), digest_size=16).digest()
        if key in self.seen:
            out.add("duplicate", i, f"same as row {shown_row(self.seen[key])}")
        else:
            self.seen[key] = i

        for text in _texts(example):
            if self.any_special is None or not self.any_special.search(text):
                continue
            hit = next((s for s in self.specials if s in text), None)
            if hit:
                out.add("special_tokens", i, f"contains {hit!r}")
                break

        # The last answer's end is missing_eos' business (below); this names an earlier one.
        for n, answer in enumerate(tok.answers[:-1], 1):
            if not answer.ends_at_marker:
                tail = tok.text[max(answer.start, answer.end - 12) : answer.end]
                out.add("answer_end", i, f"answer {n} ends with {tail!r}, no end-of-turn token")
                break
        if any(a.reasoning_dropped for a in tok.answers):
            out.add("reasoning_dropped", i, f"earlier_reasoning: {self.cfg.earlier_reasoning}")

        kept = trained[:limit]
        if len(ids) > limit and any(trained[limit:]) and any(kept):
            out.add("truncated_answer", i, f"{len(ids)} tokens; {sum(trained[limit:])} answer tokens cut")
        if not any(kept[1:]):
            why = "the cut at max_seq_len removed every answer token" if any(trained[1:]) else "no trained token"
            out.add("fully_masked", i, why)
            return
        # The last trained token of the full row (before any cut), past trailing whitespace (a
        # template's newline after its end marker): an end marker there teaches stopping.
        last = len(trained) - 1 - trained[::-1].index(True)
        while last > 0 and trained[last - 1] and not self.piece(ids[last]).strip():
            last -= 1
        if ids[last] not in self.special_ids:
            out.add("missing_eos", i, f"the answer ends with {self.piece(ids[last])!r}, not an end-of-turn token")
