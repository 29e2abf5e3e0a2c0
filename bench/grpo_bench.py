"""W11's shared parts (GRPO on Qwen3-1.7B): the tokenizer, the prompts as text, the rewards and the
learning check, the same for ours (bench.ours_methods) and TRL's GRPOTrainer (bench.peers.trl_grpo).

The tokenizer. The reward functions read the completions as text, so the random-weight model
needs a real tokenizer of Qwen3's vocabulary: the one the conformance tests build from llama.cpp's
upstream Qwen vocabulary (tests/conformance/families.py, cached in ~/.cache/tunesmith/conformance/
families-<version>-v<n>/qwen3/: tokenizer.json, tokenizer_config.json, chat_template.jinja, 11 MiB).
`--tokenizer DIR` names it; without it the bench looks in `.gpu/qwen-tokenizer/` (git-ignored, and
carried to the GPU host: docs/GPU.md says how the files get there), then in the conformance cache.

The prompts. A step's prompts are the chain's token ids (bench.method_batches.PromptStep) decoded
to text; each implementation renders that text as one user turn through the chat template and
generates the assistant's answer, so both start from the same prompt ids.

The rewards. On random weights a completion is near-uniform over Qwen3's 151,643 ordinary tokens,
so a reward that asks for sense is 0 for every completion and GRPO's advantages are all zero. Two
rewards that such text still varies on, each logged separately (the engine's built-ins, called
the same way for both implementations):
- `length`: 0 up to `max_chars`, minus the share above it; `max_chars` is about the median
  characters of `max_new_tokens` uniform tokens (LENGTH_CHARS_PER_TOKEN), so about half of the
  completions pay and the group's spread is never zero;
- `regex` (a digit anywhere, REWARD_PATTERN): ~4% of 256-token completions hit it, a sparse
  0/1 reward like a format check.

The learning check (`grpo_check`). GRPO's loss is ~0 in value (beta x KL; the advantages sum to
zero per group) and each implementation samples its own completions, so curves are not compared
step by step as SFT's and DPO's are. With TRL's record of the same run it asks:
1. signal: every step of both had a reward spread above zero (the advantages were not all zero);
2. movement: both policies moved away from the reference: the KL of the last steps is above
   KL_FLOOR, and ours' mean KL over the steps after the first is within KL_RATIO of TRL's (the
   same objective, learning rate and advantages move the adapter by the same order);
3. direction: ours' mean reward over the second half of the steps, minus the first half's, is
   not below TRL's change by more than REWARD_SIGMAS standard errors (the steps' scatter within
   each half): ours does not move against the reward where TRL does not.
Random weights and a few steps raise the reward little; the record keeps both reward curves.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRIED_TOKENIZER = ROOT / ".gpu" / "qwen-tokenizer"  # git-ignored; travels to the GPU host
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
REWARD_PATTERN = r"(?s).*\d.*"  # a digit anywhere
LENGTH_CHARS_PER_TOKEN = 5.0  # median characters per uniform Qwen3 token (1,295 for 256 tokens)
KL_FLOOR = 1e-7
KL_RATIO = 4.0
REWARD_SIGMAS = 3.0


def conformance_tokenizer() -> Path | None:
    """The Qwen3 tokenizer folder of the conformance cache, if built."""
    root = Path(os.environ.get("TUNESMITH_CACHE", Path.home() / ".cache" / "tunesmith")) / "conformance"
    found = sorted(root.glob("families-*/qwen3/tokenizer.json"))
    return found[-1].parent if found else None


def tokenizer_dir(args=None, wl=None) -> Path | None:
    """--tokenizer, else the workload's own (a test's), else .gpu/qwen-tokenizer, else the cache."""
    named = getattr(args, "tokenizer", None) or (wl.extra.get("tokenizer") if wl is not None else None)
    if named:
        return Path(named)
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        return CARRIED_TOKENIZER
    return conformance_tokenizer()


def load_tokenizer(args=None, wl=None):
    """The Qwen3 tokenizer the W11 run reads, or NotSupported saying how to provide one."""
    from bench.runner import NotSupported

    folder = tokenizer_dir(args, wl)
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise NotSupported(
            f"W11 needs a Qwen3 tokenizer (--tokenizer DIR with {', '.join(TOKENIZER_FILES)}; "
            f"looked in {folder or CARRIED_TOKENIZER}): copy the conformance cache's qwen3 files to "
            ".gpu/qwen-tokenizer/ (docs/GPU.md, W11)"
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def prompt_texts(step, tok) -> list[str]:
    """A PromptStep's prompts as text (its chain ids decoded, special tokens left out)."""
    return [tok.decode(ids, skip_special_tokens=True) for ids in step.prompts]


def reward_configs(wl) -> list:
    """W11's rewards as the engine's RewardConfig (grpo.rewards), in logging order."""
    from engine.config import RewardConfig

    max_chars = max(1, round(LENGTH_CHARS_PER_TOKEN * int(wl.extra["max_new_tokens"])))
    return [
        RewardConfig(kind="length", max_chars=max_chars),
        RewardConfig(kind="regex", pattern=wl.extra.get("reward_pattern", REWARD_PATTERN)),
    ]


def describe_rewards(wl) -> list[str]:
    return [
        f"length: -(chars over {c.max_chars}) / {c.max_chars}" if c.kind == "length" else f"regex {c.pattern!r}"
        for c in reward_configs(wl)
    ]


def _halves(curve: list[float]) -> tuple[float, float, int]:
    """(second half's mean - first half's, its standard error, steps per half). The error is
    from the steps' scatter about their own half's mean, so a trend does not widen it."""
    n = len(curve) // 2
    a, b = curve[:n], curve[-n:]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    resid = [x - ma for x in a] + [x - mb for x in b]
    sd = math.sqrt(sum(r * r for r in resid) / max(1, len(resid) - 2))
    return mb - ma, sd * math.sqrt(2 / n), n


def grpo_check(ours: dict, trl: dict) -> dict:
    """The W11 learning check of ours' record against TRL's record of the same run (see the
    module's docstring). {"verdict": "ok" | "FAILED" | "none", "reason": ..., numbers}."""
    out: dict = {"kl_floor": KL_FLOOR, "kl_ratio": KL_RATIO, "reward_sigmas": REWARD_SIGMAS}
    curves = {}
    for name, rec in (("ours", ours), ("trl", trl)):
        c = {k: rec.get(k) or [] for k in ("reward_curve", "reward_std_curve", "kl_curve")}
        n = len(c["reward_curve"])
        if n < 4 or any(len(v) != n for v in c.values()):
            return dict(out, verdict="none", reason=f"{name}: {n} steps of reward and KL (the check needs 4)")
        if not all(math.isfinite(x) for v in c.values() for x in v):
            return dict(out, verdict="FAILED" if name == "ours" else "none", reason=f"{name}: a non-finite reward/KL")
        curves[name] = c
    bad = []
    for name, c in curves.items():
        flat = [i + 1 for i, s in enumerate(c["reward_std_curve"]) if s <= 0]
        if flat:
            bad.append(f"{name}: no reward spread at step(s) {flat} (the rewards gave no signal)")
    kl = {name: statistics.fmean(c["kl_curve"][1:]) for name, c in curves.items()}
    last_kl = {name: statistics.fmean(c["kl_curve"][-2:]) for name, c in curves.items()}
    out.update(ours_kl=kl["ours"], trl_kl=kl["trl"])
    for name, v in last_kl.items():
        if not v > KL_FLOOR:
            bad.append(f"{name}: the policy did not move (KL of the last steps {v:.2e})")
    if kl["trl"] > KL_FLOOR and not (1 / KL_RATIO <= kl["ours"] / kl["trl"] <= KL_RATIO):
        bad.append(f"mean KL {kl['ours']:.2e} vs TRL's {kl['trl']:.2e} (more than {KL_RATIO:g}x apart)")
    (d_ours, se_ours, n), (d_trl, se_trl, _) = (_halves(curves[k]["reward_curve"]) for k in ("ours", "trl"))
    se = math.hypot(se_ours, se_trl)
    out.update(ours_reward_change=d_ours, trl_reward_change=d_trl, reward_change_se=se)
    if d_ours < d_trl - REWARD_SIGMAS * se:
        bad.append(
            f"mean reward changed {d_ours:+.4f} (last {n} steps against the first {n}), TRL's {d_trl:+.4f}: "
            f"more than {REWARD_SIGMAS:g} standard errors ({se:.4f}) below"
        )
    if bad:
        return dict(out, verdict="FAILED", reason="; ".join(bad))
    return dict(
        out,
        verdict="ok",
        reason=f"reward spread every step; KL {kl['ours']:.2e} (TRL {kl['trl']:.2e}); reward change "
        f"{d_ours:+.4f} (TRL {d_trl:+.4f}, s.e. {se:.4f})",
    )


def grpo_verdict(rec: dict, records) -> dict:
    """W11's verdict for one record (bench.report.learning_verdict): ours against trl_grpo of the
    same run by grpo_check; TRL's record is the reference, other records are shown with no check."""
    from bench.report import _same_run

    impl = rec.get("impl")
    if impl == "trl_grpo":
        return {"verdict": "reference", "reason": "stock: TRL GRPOTrainer's reward and KL", "counts": True}
    refs = [r for r in records if r is not rec and _same_run(r, rec) and r.get("impl") == "trl_grpo"]
    refs = [r for r in refs if r.get("status") == "ok"]
    if impl != "ours":
        return {"verdict": "none", "reason": "GRPO: only ours is checked", "counts": True}
    if not refs:
        return {"verdict": "none", "counts": False, "reason": f"no trl_grpo record in run {rec.get('run_id') or '?'}"}
    c = grpo_check(rec, refs[0])
    label = {"ok": "ok", "FAILED": "FAILED", "none": "no learning check"}[c["verdict"]]
    return dict(c, reference="trl_grpo", counts=c["verdict"] == "ok", reason=f"{label} vs trl_grpo: {c['reason']}")
