"""Benchmark records: environment facts, results.jsonl appends, the console table, RESULTS.md.

One JSON object per (workload, implementation) run, appended as soon as it is measured so a
run killed at a time limit keeps what it finished. RESULTS.md is always regenerated from
results.jsonl (`python -m engine.bench --summarize`), never edited by hand.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS = BENCH_DIR / "results.jsonl"
DEFAULT_MD = BENCH_DIR / "RESULTS.md"
PEER_IMPLS = ("hf_sdpa", "hf_flex", "liger_sdpa", "liger_flex", "unsloth")


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
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                             text=True, timeout=10)
        sha = out.stdout.strip()
        if out.returncode != 0 or not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH_DIR,
                               capture_output=True, text=True, timeout=10).stdout.strip()
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
        return p.name[len("unsloth-"):-len(".dist-info")]
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


def format_table(records: Iterable[dict]) -> str:
    """The console table printed at the end of a run."""
    rows = [("workload", "impl", "status", "tok/s", "min-max tok/s", "step s", "peak GiB",
             "reserved GiB", "ceiling", "loss first->last")]
    for r in records:
        status = r.get("status", "?")
        ok = status == "ok"
        rows.append((
            r.get("workload", "?"), impl_label(r), status if len(status) <= 60 else status[:57] + "...",
            _fmt(r.get("tokens_per_s")) if ok else "-",
            f"{_fmt(r.get('tokens_per_s_min'))}-{_fmt(r.get('tokens_per_s_max'))}" if ok else "-",
            _fmt(r.get("step_s"), ".3f") if ok else "-",
            _fmt(r.get("peak_gib"), ".2f"), _fmt(r.get("reserved_gib"), ".2f"),
            _fmt(100 * r["ceiling_fraction"], ".1f") + "%" if ok and r.get("ceiling_fraction") else "-",
            f"{_fmt(r.get('first_loss'), '.4f')}->{_fmt(r.get('last_loss'), '.4f')}"
            if r.get("first_loss") is not None else "-",
        ))
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


def summarize(results: str | Path = DEFAULT_RESULTS, md: str | Path = DEFAULT_MD) -> str:
    """Regenerate RESULTS.md from results.jsonl; returns the text written."""
    from engine.bench.workloads import WORKLOADS

    records = read_records(results)
    speed = [r for r in records if r.get("mode", "bench") == "bench"]
    out = ["# Benchmark results", "",
           f"Generated by `python -m engine.bench --summarize` from `{Path(results).name}` "
           f"({len(records)} records). Per workload, the latest record of each implementation "
           "and GPU; \"vs best peer\" is tokens/s over the fastest peer's (HF + PEFT, Liger, "
           "Unsloth) in the same table. Rows with the same run id were measured in one process run, "
           "one after another on the same batches; compare ratios within a run. Recipe and "
           "targets: WORKLOADS.md.", ""]
    by_wl: "OrderedDict[str, list[dict]]" = OrderedDict()
    for r in speed:
        by_wl.setdefault(r["workload"], []).append(r)
    order = {k: i for i, k in enumerate(list(WORKLOADS) + ["CPU-tiny"])}
    for wid in sorted(by_wl, key=lambda k: (order.get(k, 99), k)):
        latest = list(_latest_per_key(by_wl[wid], lambda r: (r.get("gpu"), impl_label(r))).values())
        for gpu in dict.fromkeys(r.get("gpu") for r in latest):
            rows = [r for r in latest if r.get("gpu") == gpu]
            wl = WORKLOADS.get(wid)
            title = f"{wid}: {wl.title}" if wl else wid
            out += [f"## {title} ({gpu})", ""]
            if wl and wl.target:
                out += [f"Target: {wl.target}.", ""]
            peers = [r for r in rows if _is_peer(r.get("impl")) and r.get("status") == "ok"
                     and r.get("tokens_per_s")]
            best = max((r["tokens_per_s"] for r in peers), default=None)
            unit = "blocks fwd+bwd: tokens/s" if wl and wl.kind == "moe_block" else "tokens/s"
            out += [f"| impl | status | {unit} | min-max | peak GiB | reserved GiB | ceiling | vs best peer | date | commit | run |",
                    "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(rows, key=lambda r: -(r.get("tokens_per_s") or 0) if r.get("status") == "ok" else 1e18):
                ok = r.get("status") == "ok"
                vs = f"{r['tokens_per_s'] / best:.2f}x" if ok and best and r.get("tokens_per_s") else "-"
                out.append("| " + " | ".join([
                    impl_label(r), r.get("status", "?").replace("|", "/").replace("\n", " ")[:120],
                    _fmt(r.get("tokens_per_s")) if ok else "-",
                    f"{_fmt(r.get('tokens_per_s_min'))}-{_fmt(r.get('tokens_per_s_max'))}" if ok else "-",
                    _fmt(r.get("peak_gib"), ".2f"), _fmt(r.get("reserved_gib"), ".2f"),
                    (_fmt(100 * r["ceiling_fraction"], ".1f") + "%") if ok and r.get("ceiling_fraction") else "-",
                    vs, (r.get("date") or "")[:16], (r.get("commit") or "")[:10],
                    (r.get("run_id") or "")[9:15],
                ]) + " |")
            out.append("")
    unmeasured = [w for w in WORKLOADS if w not in by_wl and not any(
        r.get("workload") == w for r in records)]
    if unmeasured:
        out += ["## Not measured yet", "",
                "No record in results.jsonl yet for: " + ", ".join(
                    f"{w} ({WORKLOADS[w].title})" for w in unmeasured) + ".", ""]
    memcap = [r for r in records if r.get("mode") == "memcap"]
    if memcap:
        out += ["## W7: longest single sequence that trains under a memory cap", "",
                "| impl | status | longest tokens | cap GiB | trials | gpu | date |", "|---|---|---|---|---|---|---|"]
        for r in _latest_per_key(memcap, lambda r: (r.get("gpu"), r.get("workload"), impl_label(r))).values():
            trials = ", ".join(f"{t['tokens']}:{'ok' if t['ok'] else 'oom'}" for t in r.get("trials", []))
            out.append(f"| {impl_label(r)} | {r.get('status')} | {_fmt(r.get('longest_tokens'))} | "
                       f"{r.get('cap_gib')} | {trials} | {r.get('gpu')} | {(r.get('date') or '')[:16]} |")
        out.append("")
    parity = [r for r in records if r.get("mode") == "parity"]
    if parity:
        out += ["## Parity: one step against HF + PEFT in fp32", "",
                "| workload | dtype | status | loss rel err | LoRA grad rel err max / global | tolerance | stock HF+PEFT same dtype max / global | gpu | date |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in _latest_per_key(parity, lambda r: (r.get("gpu"), r.get("workload"), r.get("dtype"))).values():
            out.append(f"| {r.get('workload')} | {r.get('dtype')} | {r.get('status')} | "
                       f"{_fmt(r.get('loss_rel_err'), '.2e')} | {_fmt(r.get('grad_rel_err_max'), '.2e')} / "
                       f"{_fmt(r.get('grad_rel_err_global'), '.2e')} | {_fmt(r.get('tolerance'), '.0e')} | "
                       f"{_fmt(r.get('hf_same_dtype_grad_rel_err_max'), '.2e')} / "
                       f"{_fmt(r.get('hf_same_dtype_grad_rel_err_global'), '.2e')} | "
                       f"{r.get('gpu')} | {(r.get('date') or '')[:16]} |")
        out.append("")
    text = "\n".join(out).rstrip() + "\n"
    Path(md).write_text(text, encoding="utf-8")
    return text


def progress(msg: str) -> None:
    """One progress line, flushed at once: GPU runs are killed at a time limit."""
    print(f"[bench {_dt.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
