"""Benchmark records: environment facts, results.jsonl appends, the console table, RESULTS.md.

One JSON object per (workload, implementation) run, appended as soon as it is measured so a
run killed at a time limit keeps what it finished. RESULTS.md is always regenerated from
results.jsonl (`python -m bench --summarize`), never edited by hand.

The learning check lives here (`learning_check`, a pure function on two loss curves, and
`learning_verdict`, which finds the stock curve of a record's own run): the summary and the
console table show a speed of ours only where it passed, and take ratios within one run only.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import statistics
import subprocess
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS = BENCH_DIR / "results" / "results.jsonl"
DEFAULT_MD = BENCH_DIR / "results" / "RESULTS.md"
# Records from before the learning check (2026-11-30): uniform random token ids, no loss curve,
# so none of them counts as a speed of ours. Kept apart, read only for RESULTS.md's history.
HISTORY_UNCHECKED = BENCH_DIR / "results" / "history-before-learning-check.jsonl"
PEER_IMPLS = (
    "hf_sdpa",
    "hf_flex",
    "hf_varlen",
    "liger_sdpa",
    "liger_flex",
    "liger_varlen",
    "trl_sdpa",
    "trl_flex",
    "trl_varlen",
    "trl_liger",
    "trl_liger_flex",
    "trl_liger_varlen",
    "unsloth",
    "trl_dpo",  # W10 (bench.peers.trl_dpo, bench.peers.liger_dpo)
    "trl_dpo_liger",
    "liger_dpo_varlen",
    "trl_grpo",  # W11 (bench.peers.trl_grpo): TRL's GRPOTrainer + PEFT without vLLM
)


def _is_peer(impl) -> bool:
    """A peer's record: the training peers, or transformers' MoE experts implementations (W5)."""
    return impl in PEER_IMPLS or str(impl).startswith("hf_moe_")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def git_commit() -> str:
    # The GPU host gets a copy of the working tree without .git: the caller passes the commit.
    if os.environ.get("TUNESMITH_COMMIT"):
        return os.environ["TUNESMITH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        if out.returncode != 0 or not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unsloth_bundle_version(site: str | None) -> str | None:
    """The Unsloth version of an unpacked bundle, read from its dist-info (no import)."""
    if not site:
        return None
    for p in Path(site).glob("unsloth-*.dist-info"):
        return p.name[len("unsloth-") : -len(".dist-info")]
    return None


def environment(unsloth_site: str | None = None) -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "commit": git_commit(),
        "gpu": gpu,
        "versions": {
            "torch": torch.__version__,
            "triton": _dist_version("triton"),
            "transformers": _dist_version("transformers"),
            "peft": _dist_version("peft"),
            "liger": _dist_version("liger-kernel") or _dist_version("liger_kernel"),
            "trl": _dist_version("trl"),
            "unsloth": _dist_version("unsloth") or unsloth_bundle_version(unsloth_site),
            "bitsandbytes": _dist_version("bitsandbytes"),
        },
    }


def impl_label(rec: dict) -> str:
    variant = (rec.get("options") or {}).get("variant")
    return f"{rec['impl']}[{variant}]" if variant and variant != "all-on" else rec["impl"]


def append_record(path: str | Path, rec: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=False) + "\n")
        f.flush()


def read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            print(f"{path}:{i}: skipped a line that is not JSON ({exc})", flush=True)
    return out


def _fmt(v, spec: str = ",.0f", none: str = "-") -> str:
    if v is None:
        return none
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


# -- the learning check (WORKLOADS.md, "The common recipe") -------------------------------------

# A speed of ours counts only when its loss curve learns like stock HF + PEFT's in the same run.
MIN_FALL = 0.3  # nats the stock curve must fall (first step against the mean of the last three)
FALL_TOL = 0.10  # ours falls by the stock fall within 10%
STEP_TOL = 0.02  # every step of ours within 2% of the stock curve
MIN_STEPS = 4  # a first step and three more to average
# Stock references, in order of preference: HF + PEFT as people run it, then with Liger.
# trl_dpo: W10's stock curve (TRL's DPOTrainer + PEFT, no Liger), against which ours' DPO loss is held.
REFERENCE_IMPLS = ("hf_sdpa", "hf_flex", "hf_eager", "liger_sdpa", "liger_flex", "trl_dpo")
OLD_RECORD = "no loss curve (recorded before the learning check)"


def curve_fall(curve: list[float]) -> float:
    """First step's loss minus the mean of the last three (nats)."""
    return curve[0] - sum(curve[-3:]) / 3


def _finite_curve(curve) -> bool:
    return bool(curve) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in curve)


def learning_check(
    ours: list[float] | None,
    stock: list[float] | None,
    *,
    min_fall: float = MIN_FALL,
    fall_tol: float = FALL_TOL,
    step_tol: float = STEP_TOL,
) -> dict:
    """Does the curve `ours` learn like the stock curve of the same run on the same batches?

    Returns {"verdict": "ok" | "FAILED" | "none", "reason": str, ...numbers}. "none" means the
    check cannot decide (no curve, too few steps, or a stock curve that does not fall by
    `min_fall`: over a few steps a flat curve sits within 2% of a falling one, so only the fall
    tells them apart); such a record does not count as a speed either.
    """
    out: dict[str, Any] = {"verdict": "none", "min_fall": min_fall, "fall_tol": fall_tol, "step_tol": step_tol}
    if not ours:
        return dict(out, reason="no loss curve")
    if not _finite_curve(stock):
        return dict(out, reason="no usable stock curve")
    if len(ours) != len(stock):
        return dict(out, reason=f"{len(ours)} steps against the stock curve's {len(stock)}")
    if len(stock) < MIN_STEPS:
        return dict(out, reason=f"{len(stock)} steps: fewer than {MIN_STEPS} cannot show a fall")
    stock_fall = curve_fall(stock)
    out["stock_fall"] = stock_fall
    if stock_fall < min_fall:
        return dict(
            out,
            reason=f"the stock curve fell {stock_fall:.3f} nats (< {min_fall}): more steps or a "
            "higher learning rate are needed to tell a learning run from a flat one",
        )
    if not _finite_curve(ours):
        return dict(out, verdict="FAILED", reason="non-finite loss in ours")
    ours_fall = curve_fall(ours)
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, stock)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    out.update(ours_fall=ours_fall, max_step_rel_err=rel[worst], worst_step=worst + 1)
    bad = []
    if abs(ours_fall - stock_fall) > fall_tol * stock_fall:
        bad.append(f"fell {ours_fall:.3f} nats, stock {stock_fall:.3f} (more than {fall_tol:.0%} apart)")
    if rel[worst] > step_tol:
        bad.append(
            f"step {worst + 1}: {ours[worst]:.4f} vs stock {stock[worst]:.4f} ({rel[worst]:.1%} > {step_tol:.0%})"
        )
    if bad:
        return dict(out, verdict="FAILED", reason="; ".join(bad))
    return dict(
        out, verdict="ok", reason=f"fell {ours_fall:.3f} nats (stock {stock_fall:.3f}), worst step {rel[worst]:.2%}"
    )


def _same_run(a: dict, b: dict) -> bool:
    """Measured in one process run, one after another on the same batches (never across runs)."""
    return (
        a.get("run_id") is not None
        and a.get("run_id") == b.get("run_id")
        and a.get("workload") == b.get("workload")
        and a.get("gpu") == b.get("gpu")
        and a.get("mode", "bench") == b.get("mode", "bench")
    )


def _no_loss(rec: dict) -> bool:
    """Workloads whose step has no training loss (W5's MoE block forward + backward)."""
    from bench.workloads import WORKLOADS

    wl = WORKLOADS.get(rec.get("workload"))
    return bool(wl and wl.kind == "moe_block") or str(rec.get("impl", "")).startswith("hf_moe_")


def _is_grpo(rec: dict) -> bool:
    from bench.workloads import WORKLOADS

    wl = WORKLOADS.get(rec.get("workload"))
    return bool(wl and wl.kind == "grpo") or (rec.get("options") or {}).get("method") == "grpo"


def _is_dpo(rec: dict) -> bool:
    from bench.workloads import WORKLOADS

    wl = WORKLOADS.get(rec.get("workload"))
    return bool(wl and wl.kind == "dpo")


def learning_verdict(rec: dict, records: Iterable[dict]) -> dict:
    """The learning check of one record against the stock records of its own run.

    Ours (and Unsloth, for information) is checked against each stock HF + PEFT / Liger record
    of the same run that has a curve, in REFERENCE_IMPLS order: the first that passes is the
    verdict, else the first that failed, else why no check could be made. A stock record gets
    its own fall. `counts` says whether the record's speed may be shown.
    """
    impl = rec.get("impl")
    if _no_loss(rec):
        return {"verdict": "n/a", "reason": "n/a (MoE block: no training loss)", "counts": True}
    if _is_grpo(rec):  # W11: GRPO's own check against TRL's record of the run (bench.grpo_bench)
        from bench.grpo_bench import grpo_verdict

        return grpo_verdict(rec, records)
    curve = rec.get("loss_curve")
    if impl in REFERENCE_IMPLS:
        if not curve:
            return {"verdict": "none", "reason": OLD_RECORD, "counts": True}
        if not _finite_curve(curve):
            return {"verdict": "none", "reason": "stock: non-finite loss", "counts": True}
        if len(curve) < MIN_STEPS:
            return {"verdict": "none", "reason": f"stock: {len(curve)} steps, too few to show a fall", "counts": True}
        fall = curve_fall(curve)
        note = "" if fall >= MIN_FALL else f" (< {MIN_FALL}: cannot check others)"
        return {
            "verdict": "reference",
            "reason": f"stock: fell {fall:.3f} nats{note}",
            "counts": True,
            "stock_fall": fall,
        }
    counts_anyway = impl != "ours"  # the gate is on ours; a peer's speed is shown with its note
    if not curve:
        return {"verdict": "none", "reason": OLD_RECORD, "counts": counts_anyway}
    if _is_dpo(rec):  # W10: against TRL's DPO curve at the run's noise floor (bench.dpo_check)
        from bench.dpo_check import dpo_verdict

        return dpo_verdict(rec, records, counts_anyway)
    refs = {}
    for r in records:
        if (
            r is not rec
            and _same_run(r, rec)
            and r.get("impl") in REFERENCE_IMPLS
            and r.get("status") == "ok"
            and r.get("loss_curve")
        ):
            refs.setdefault(r["impl"], r)  # first in file order: one record per impl and run
    if not refs:
        return {
            "verdict": "none",
            "counts": counts_anyway,
            "reason": f"no stock HF + PEFT / Liger curve in run {rec.get('run_id') or '?'}",
        }
    checks = [(name, learning_check(curve, refs[name]["loss_curve"])) for name in REFERENCE_IMPLS if name in refs]
    for want in ("ok", "FAILED", "none"):
        for name, c in checks:
            if c["verdict"] == want:
                label = {"ok": "ok", "FAILED": "FAILED", "none": "no learning check"}[want]
                return dict(
                    c, reference=name, counts=counts_anyway or want == "ok", reason=f"{label} vs {name}: {c['reason']}"
                )
    raise AssertionError("unreachable")


def speed_cell(rec: dict, verdict: dict) -> str | None:
    """What stands in the tokens/s column instead of a speed (None: show the speed)."""
    if rec.get("status") != "ok":
        return "-"
    if verdict["counts"]:
        return None
    return "FAILED learning" if verdict["verdict"] == "FAILED" else "no learning check"


def best_peer_same_run(rec: dict, records: Iterable[dict]) -> float | None:
    """The fastest peer's tokens/s in the record's own run (ratios never span runs)."""
    best = None
    for r in records:
        if _same_run(r, rec) and _is_peer(r.get("impl")) and r.get("status") == "ok" and r.get("tokens_per_s"):
            best = max(best or 0.0, r["tokens_per_s"])
    return best


def format_table(records: Iterable[dict]) -> str:
    """The console table printed at the end of a run (the learning check within these records)."""
    records = list(records)
    rows = [
        (
            "workload",
            "impl",
            "status",
            "tok/s",
            "min-max tok/s",
            "step s",
            "peak GiB",
            "reserved GiB",
            "ceiling",
            "loss first->last",
            "learning",
        )
    ]
    for r in records:
        status = r.get("status", "?")
        ok = status == "ok"
        v = learning_verdict(r, records) if r.get("mode", "bench") == "bench" else {"reason": "-", "counts": True}
        cell = speed_cell(r, v) if r.get("mode", "bench") == "bench" else None
        rows.append(
            (
                r.get("workload", "?"),
                impl_label(r),
                status if len(status) <= 60 else status[:57] + "...",
                cell or (_fmt(r.get("tokens_per_s")) if ok else "-"),
                f"{_fmt(r.get('tokens_per_s_min'))}-{_fmt(r.get('tokens_per_s_max'))}" if ok and not cell else "-",
                _fmt(r.get("step_s"), ".3f") if ok and not cell else "-",
                _fmt(r.get("peak_gib"), ".2f"),
                _fmt(r.get("reserved_gib"), ".2f"),
                _fmt(100 * r["ceiling_fraction"], ".1f") + "%"
                if ok and not cell and r.get("ceiling_fraction")
                else "-",
                f"{_fmt(r.get('first_loss'), '.4f')}->{_fmt(r.get('last_loss'), '.4f')}"
                if r.get("first_loss") is not None
                else "-",
                v["reason"] if len(v["reason"]) <= 90 else v["reason"][:87] + "...",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- RESULTS.md ----------------------------------------------------------------------------------


def _latest_per_key(records: list[dict], key) -> "OrderedDict[Any, dict]":
    latest: "OrderedDict[Any, dict]" = OrderedDict()
    # By date, not file order: --merge appends a call's records whenever it is run, so a file
    # can hold an older run after a newer one. Equal dates keep file order (stable sort).
    for r in sorted(records, key=lambda r: str(r.get("date") or "")):
        latest[key(r)] = r
    return latest


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _speed_row(r: dict, records: list[dict], history: bool, best: float | None = None) -> str:
    """One row of a workload's table: a speed only where the learning check lets it count.
    `best`: the fastest peer of the row's run (default: looked up among `records`)."""
    ok = r.get("status") == "ok"
    v = r.get("_verdict") or learning_verdict(r, records)
    instead = speed_cell(r, v)
    shown = ok and instead is None
    if not shown:
        best = None
    elif best is None:
        best = best_peer_same_run(r, records)
    vs = f"{r['tokens_per_s'] / best:.2f}x" if best and r.get("tokens_per_s") else "-"
    cells = [
        impl_label(r),
        _cell(r.get("status", "?"))[:120],
        instead or _fmt(r.get("tokens_per_s")),
        f"{_fmt(r.get('tokens_per_s_min'))}-{_fmt(r.get('tokens_per_s_max'))}" if shown else "-",
        # A run that did not learn may not have done the work: its memory is no figure either.
        _fmt(r.get("peak_gib"), ".2f") if shown or not ok else "-",
        _fmt(r.get("reserved_gib"), ".2f") if shown or not ok else "-",
        (_fmt(100 * r["ceiling_fraction"], ".1f") + "%") if shown and r.get("ceiling_fraction") else "-",
        vs,
        _cell(v["reason"]),
        (r.get("date") or "")[:16],
        (r.get("commit") or "")[:10],
        r.get("run_id") or "-",
    ]
    if history:
        cells = [cells[9], cells[11], cells[10]] + cells[:9]
    return "| " + " | ".join(cells) + " |"


def combine_repeats(group: list[dict], records: list[dict]) -> dict:
    """One implementation's repeats within one run (``--repeat N``) as one row: the median
    tokens/s, the range over the repeats' own tokens/s, the highest peak; its learning check
    counts only when every repeat's did."""
    if len(group) == 1:
        return group[0]
    ok = [r for r in group if r.get("status") == "ok" and r.get("tokens_per_s")]
    if not ok:
        return group[-1]
    speeds = [r["tokens_per_s"] for r in ok]
    row = dict(ok[0])
    row.update(
        tokens_per_s=statistics.median(speeds),
        tokens_per_s_min=min(speeds),
        tokens_per_s_max=max(speeds),
        peak_gib=max(r.get("peak_gib") or 0.0 for r in ok),
        reserved_gib=max(r.get("reserved_gib") or 0.0 for r in ok),
        repeats=len(ok),
    )
    if row.get("ceiling_tokens_per_s"):
        row["ceiling_fraction"] = row["tokens_per_s"] / row["ceiling_tokens_per_s"]
    verdicts = [learning_verdict(r, records) for r in ok]
    row["_verdict"] = dict(
        verdicts[0],
        counts=all(v["counts"] for v in verdicts),
        reason=f"{sum(v['verdict'] in ('ok', 'reference') for v in verdicts)}/{len(ok)} repeats: "
        + verdicts[0]["reason"],
    )
    if any(v["verdict"] == "FAILED" for v in verdicts):
        row["_verdict"] = next(v for v in verdicts if v["verdict"] == "FAILED")
    return row


def _latest_run_section(mine: list[dict], records: list[dict], header: str, rule: str) -> list[str]:
    """The headline table of one workload and GPU: every implementation of its newest run whose ours
    passed its learning check, else of its newest run that measured ours (rows of different runs
    never stand side by side; ratios stay in the run). A later run without a stock curve (a
    "before" measurement of a lever) stays in the history instead of hiding the checked speed."""
    runs = [r for r in mine if r.get("run_id")]
    with_ours = [r for r in runs if r.get("impl") == "ours"] or runs
    if not with_ours:
        return []
    checked = [r for r in with_ours if learning_verdict(r, records).get("verdict") == "ok"]
    run_id = max(checked or with_ours, key=lambda r: str(r.get("date") or ""))["run_id"]
    in_run = [r for r in mine if r.get("run_id") == run_id]
    groups: "OrderedDict[str, list[dict]]" = OrderedDict()
    for r in in_run:
        groups.setdefault(impl_label(r), []).append(r)
    rows = [combine_repeats(g, records) for g in groups.values()]
    peers = [r for r in rows if _is_peer(r.get("impl")) and r.get("status") == "ok" and r.get("tokens_per_s")]
    best = max((r["tokens_per_s"] for r in peers), default=None)
    first = in_run[0]
    reps = max(len(g) for g in groups.values())
    out = [
        f"Latest run {run_id} (commit {(first.get('commit') or '?')[:10]}, {(first.get('date') or '')[:16]})"
        + (f", {reps} repeats of each implementation: median tokens/s, range over the repeats" if reps > 1 else "")
        + ":",
        "",
        header,
        rule,
    ]

    def sort_key(r):
        v = r.get("_verdict") or learning_verdict(r, records)
        shown = r.get("status") == "ok" and speed_cell(r, v) is None
        return -(r.get("tokens_per_s") or 0) if shown else 1e18

    for r in sorted(rows, key=sort_key):
        out.append(_speed_row(r, records, history=False, best=best))
    return out + [""]


SPEED_HEADER = [
    "impl",
    "status",
    "tokens/s",
    "min-max",
    "peak GiB",
    "reserved GiB",
    "ceiling",
    "vs best peer (same run)",
    "learning check",
    "date",
    "commit",
    "run",
]


def summarize(results: str | Path = DEFAULT_RESULTS, md: str | Path = DEFAULT_MD) -> str:
    """Regenerate RESULTS.md from results.jsonl; returns the text written."""
    from bench.workloads import WORKLOADS

    records = read_records(results)
    if Path(results) == DEFAULT_RESULTS and HISTORY_UNCHECKED.exists():
        records = read_records(HISTORY_UNCHECKED) + records
    speed = [r for r in records if r.get("mode", "bench") == "bench"]
    out = [
        "# Benchmark results",
        "",
        f"Generated by `python -m bench --summarize` from `{Path(results).name}` "
        + (f"and `{HISTORY_UNCHECKED.name}` " if Path(results) == DEFAULT_RESULTS else "")
        + f"({len(records)} records). Per workload and GPU: every implementation of the newest run "
        "whose ours passed its learning check, else of the newest that measured ours (one run id: same "
        "batches, same process), then every record of every run (newest first). Recipe, learning check "
        "and targets: WORKLOADS.md.",
        "",
        f"- A speed of ours is shown only when its learning check passed: the same run (same run id) "
        f"has a stock HF + PEFT (or Liger) loss curve on the same batches that falls by at least "
        f"{MIN_FALL} nats (first step against the mean of the last three), ours falls by the same "
        f"within {FALL_TOL:.0%}, and every step of ours is within {STEP_TOL:.0%} of the stock curve. "
        'Otherwise the row says "FAILED learning" or "no learning check" (records from before '
        "the check have no loss curve; their token ids were uniform random and could not be learned).",
        '- "vs best peer (same run)" is tokens/s over the fastest peer\'s (HF + PEFT, Liger, TRL, Unsloth) '
        "of the same run id; ratios are never taken across runs. With `--repeat N` a run measures each "
        "implementation N times (interleaved); the headline row shows the median and the range.",
        "",
    ]
    by_wl: "OrderedDict[str, list[dict]]" = OrderedDict()
    for r in speed:
        by_wl.setdefault(r["workload"], []).append(r)
    order = {k: i for i, k in enumerate(list(WORKLOADS) + ["CPU-tiny"])}
    header = "| " + " | ".join(SPEED_HEADER) + " |"
    rule = "|" + "---|" * len(SPEED_HEADER)
    hist_cols = [SPEED_HEADER[9], SPEED_HEADER[11], SPEED_HEADER[10]] + SPEED_HEADER[:9]
    for wid in sorted(by_wl, key=lambda k: (order.get(k, 99), k)):
        for gpu in dict.fromkeys(r.get("gpu") for r in by_wl[wid]):
            mine = [r for r in by_wl[wid] if r.get("gpu") == gpu]
            wl = WORKLOADS.get(wid)
            title = f"{wid}: {wl.title}" if wl else wid
            out += [f"## {title} ({gpu})", ""]
            if wl and wl.target:
                out += [f"Target: {wl.target}.", ""]
            if wl and wl.kind == "moe_block":
                out += [
                    "Speeds are MoE block forward + backward tokens/s (no training loss, so no learning check).",
                    "",
                ]
            out += _latest_run_section(mine, records, header, rule)
            hist = sorted(mine, key=lambda r: str(r.get("date") or ""), reverse=True)
            out += [
                "<details><summary>History: all {} records, newest first</summary>".format(len(hist)),
                "",
                "| " + " | ".join(hist_cols) + " |",
                "|" + "---|" * len(hist_cols),
            ]
            out += [_speed_row(r, records, history=True) for r in hist]
            out += ["", "</details>", ""]
    unmeasured = [w for w in WORKLOADS if w not in by_wl and not any(r.get("workload") == w for r in records)]
    if unmeasured:
        out += [
            "## Not measured yet",
            "",
            "No record in results.jsonl yet for: " + ", ".join(f"{w} ({WORKLOADS[w].title})" for w in unmeasured) + ".",
            "",
        ]
    memcap = [r for r in records if r.get("mode") == "memcap"]
    if memcap:
        out += [
            "## W7: longest single sequence that trains under a memory cap",
            "",
            "Every search, newest first; the implementations of one run searched in the same call. A search "
            "range that starts above 1,024 tried only lengths from its start (a check of one length where "
            "start and end are equal).",
            "",
            "| impl | status | longest tokens | peak GiB | cap GiB | searched | trials | gpu | date | commit | run |",
            "|" + "---|" * 11,
        ]
        for r in sorted(memcap, key=lambda r: str(r.get("date") or ""), reverse=True):
            trials = ", ".join(f"{t['tokens']}:{'ok' if t['ok'] else 'oom'}" for t in r.get("trials", []))
            lo, hi = (r.get("search_range") or [None, None])[:2]
            searched = f"{_fmt(lo)}-{_fmt(hi)}" if lo is not None else "-"
            peak = r.get("peak_gib")
            out.append(
                f"| {impl_label(r)} | {r.get('status')} | {_fmt(r.get('longest_tokens'))} | "
                f"{f'{peak:.2f}' if isinstance(peak, (int, float)) else '-'} | {r.get('cap_gib')} | {searched} | "
                f"{trials} | {r.get('gpu')} | {(r.get('date') or '')[:16]} | {r.get('commit') or '-'} | "
                f"{r.get('run_id') or '-'} |"
            )
        out.append("")
    learning = [r for r in records if r.get("mode") == "learning"]
    if learning:
        out += [
            "## Learning check (`--parity`): ours against stock HF + PEFT over many steps",
            "",
            "| workload | variant | stock | dtype | steps | lr | status | stock fall | ours fall | worst step | "
            "loss stock first->last | loss ours first->last | gpu | date | commit | run |",
            "|" + "---|" * 16,
        ]
        for r in sorted(learning, key=lambda r: str(r.get("date") or ""), reverse=True):
            sc, oc = r.get("ref_loss_curve") or [], r.get("loss_curve") or []
            out.append(
                "| "
                + " | ".join(
                    _cell(x)
                    for x in [
                        r.get("workload"),
                        r.get("variant"),
                        r.get("ref_impl"),
                        r.get("dtype"),
                        r.get("steps"),
                        _fmt(r.get("lr"), ".0e"),
                        str(r.get("status"))[:160],
                        _fmt(r.get("stock_fall"), ".3f"),
                        _fmt(r.get("ours_fall"), ".3f"),
                        (_fmt(100 * r["max_step_rel_err"], ".2f") + "%")
                        if r.get("max_step_rel_err") is not None
                        else "-",
                        f"{_fmt(sc[0] if sc else None, '.4f')}->{_fmt(sc[-1] if sc else None, '.4f')}",
                        f"{_fmt(oc[0] if oc else None, '.4f')}->{_fmt(oc[-1] if oc else None, '.4f')}",
                        r.get("gpu"),
                        (r.get("date") or "")[:16],
                        (r.get("commit") or "")[:10],
                        r.get("run_id") or "-",
                    ]
                )
                + " |"
            )
        out.append("")
    parity = [r for r in records if r.get("mode") == "parity"]
    if parity:
        out += [
            "## Parity: one step against HF + PEFT in fp32",
            "",
            "| workload | dtype | status | loss rel err | LoRA grad rel err max / global | tolerance"
            " | stock HF+PEFT same dtype max / global | gpu | date |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in _latest_per_key(parity, lambda r: (r.get("gpu"), r.get("workload"), r.get("dtype"))).values():
            out.append(
                f"| {r.get('workload')} | {r.get('dtype')} | {r.get('status')} | "
                f"{_fmt(r.get('loss_rel_err'), '.2e')} | {_fmt(r.get('grad_rel_err_max'), '.2e')} / "
                f"{_fmt(r.get('grad_rel_err_global'), '.2e')} | {_fmt(r.get('tolerance'), '.0e')} | "
                f"{_fmt(r.get('hf_same_dtype_grad_rel_err_max'), '.2e')} / "
                f"{_fmt(r.get('hf_same_dtype_grad_rel_err_global'), '.2e')} | "
                f"{r.get('gpu')} | {(r.get('date') or '')[:16]} |"
            )
        out.append("")
    if Path(results) == DEFAULT_RESULTS:
        out += multi_gpu_section(MULTI_GPU) + laptop_section(LAPTOP)
        if LEVERS.exists():  # the targets' standing and the levers tried: kept by hand
            out += ["", LEVERS.read_text(encoding="utf-8").rstrip(), ""]
    text = "\n".join(out).rstrip() + "\n"
    Path(md).write_text(text, encoding="utf-8")
    return text


# Records of the benches that run `tunesmith train` itself (bench.ddp, bench.fsdp, bench.laptop),
# committed beside results.jsonl; a record with "missing" says why a measurement is not there.
MULTI_GPU = BENCH_DIR / "results" / "multi_gpu.jsonl"
LAPTOP = BENCH_DIR / "results" / "laptop.jsonl"
LEVERS = BENCH_DIR / "results" / "levers.md"


def multi_gpu_section(path: Path) -> list[str]:
    """DDP (1 GPU against N in one call, same global batch) and FSDP2 rows."""
    if not path.exists():
        return []
    out = ["## More than one GPU (bench.ddp, bench.fsdp)", ""]
    out += [
        "| bench | model | GPUs | tokens/s (whole world) | vs 1 GPU (same call) | peak GiB per GPU "
        "| loss first -> last | commit | date | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in read_records(path):
        date, commit = (r.get("time") or r.get("date") or "")[:16], (r.get("commit") or "")[:10]
        if r.get("bench") == "fsdp":
            shape = r.get("shape") or {}
            losses = r.get("losses") or []
            out.append(
                f"| fsdp | {r.get('model', 'Llama-3.1-70B shape')} ({shape.get('layers')} layers, "
                f"{_fmt((r.get('base_params') or 0) / 1e9, '.1f')}B bf16, LoRA r=16) | {r.get('world_size')} | "
                f"{_fmt(r.get('tokens_per_s_median'), ',.0f')} | - | "
                f"{' / '.join(str(x) for x in r.get('peak_mem_gib_per_gpu') or [])} | "
                f"{_fmt(losses[0] if losses else None, '.3f')} -> {_fmt(losses[-1] if losses else None, '.3f')} | "
                f"{commit} | {date} | {r.get('note', '')} |"
            )
        elif r.get("bench") == "ddp":
            n = r.get("gpus")
            loss = r.get(f"loss_{n}") or []
            out.append(
                f"| ddp | {r.get('model')} | {n} | {_fmt(r.get(f'tokens_per_s_{n}'), ',.0f')} | "
                f"{_fmt(r.get('speedup'), '.2f')}x | {_fmt(r.get(f'peak_gib_{n}'), '.2f')} | "
                f"{_fmt(loss[0] if loss else None, '.3f')} -> {_fmt(loss[-1] if loss else None, '.3f')} | "
                f"{commit} | {date} | {r.get('note', '')} |"
            )
        else:
            out.append(
                f"| {r.get('bench')} | {r.get('model', '-')} | {r.get('gpus', '-')} | missing | - | - | - "
                f"| {commit} | {date} | {r.get('missing')} |"
            )
    return out + [""]


def laptop_section(path: Path) -> list[str]:
    """The laptop cards emulated on the H200 (WORKLOADS.md W8): bench.laptop's table."""
    if not path.exists():
        return []
    from bench.laptop import latest_per_case, records, table

    rows = records(str(path))
    return [
        "## Laptop cards emulated on the H200 (bench.laptop, W8)",
        "",
        "`tunesmith train` on a studio preset with every setting auto, the process capped at the card's size "
        "(TUNESMITH_EMULATE_GPU). Peak is torch's peak allocated memory; reserved is what the process held on "
        "the card, which the cap applies to (recorded by bench.laptop after commit 1afb4a0; '-' in older "
        "records). tokens/s is an H200's under the cap (shared by the cases that ran side by side), not a laptop's.",
        "",
        "### Each case's latest record",
        "",
        table(latest_per_case(rows)),
        "",
        "### Every record, oldest first",
        "",
        table(rows),
        "",
    ]


def progress(msg: str) -> None:
    """One progress line, flushed at once: GPU runs are killed at a time limit."""
    print(f"[bench {_dt.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
