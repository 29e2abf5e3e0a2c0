"""Measure the data X-ray on a big chat file: rows per second and peak memory (issue 28).

    python scripts/xray_speed.py make big.jsonl                  # 354,657 chat rows, about 200 MB
    python scripts/xray_speed.py scan big.jsonl --tokenizer demo --rows 5000 [--profile out.prof]
    python scripts/xray_speed.py scan big.jsonl --tokenizer qwen3      # a conformance family's folder

`make` writes rows like the file of issue 28 (OpenAI-style `messages` with an optional system
prompt and one to four user/assistant exchanges of varied length), from a fixed seed, so two
machines measure the same file. Nothing here is committed data: the file is made where it is
measured. `scan` runs engine.data.scan.xray_scan (the Data page's X-ray) over the first `--rows`
rows (all when 0), printing the time to read the file into Arrow, the scan's rows per second
(wall clock, and per CPU second: less moved by other load), the finding counts, the peak RSS
(resource.getrusage) and the load average, so a number is never read without the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 354_657  # the file
WORDS = (
    "the a of to and in is it that for on with as this be at by from or an are was not but have you can "
    "model data train answer question value list number step file code function return loop error test "
    "python string memory token layer batch output input result example system user reason because first "
    "then after before each every which when where how why what could would should might must small large "
    "quick slow simple careful exact similar different important useful common rare early late new old"
).split()
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a careful tutor who explains each step before giving the result, and checks the arithmetic.",
]


def _sentence(rnd: random.Random, lo: int, hi: int) -> str:
    words = [rnd.choice(WORDS) for _ in range(rnd.randint(lo, hi))]
    if rnd.random() < 0.3:
        words.insert(rnd.randrange(len(words)), str(rnd.randint(0, 99999)))
    return " ".join(words).capitalize() + rnd.choice([".", ".", "?", "!"])


def _text(rnd: random.Random, sentences_lo: int, sentences_hi: int) -> str:
    return " ".join(_sentence(rnd, 4, 16) for _ in range(rnd.randint(sentences_lo, sentences_hi)))


def make(path: Path, rows: int, seed: int = 28) -> int:
    """Write `rows` chat rows to `path`; returns the bytes written."""
    rnd = random.Random(seed)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            messages = []
            if rnd.random() < 0.4:
                messages.append({"role": "system", "content": rnd.choice(SYSTEMS)})
            for _turn in range(rnd.choices([1, 2, 3, 4], weights=[55, 25, 12, 8])[0]):
                messages.append({"role": "user", "content": _text(rnd, 1, 2)})
                long = rnd.random() < 0.1  # a few long answers (the histogram's tail)
                messages.append({"role": "assistant", "content": _text(rnd, 5, 20) if long else _text(rnd, 1, 3)})
            line = json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
    return size


def _tokenizer(name: str):
    from engine.api import RunConfig, load_tokenizer

    if name == "demo":
        return load_tokenizer(RunConfig().model)
    from tests.conformance.families import build_family_folder

    return load_tokenizer(RunConfig.from_dict({"model": {"name_or_path": str(build_family_folder(name))}}).model)


def _rss_now() -> dict:
    try:
        status = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = {line.split(":")[0]: line.split()[1] for line in status if line.startswith(("RssAnon", "RssFile"))}
    return {f"{k.lower()}_mb": round(int(v) / 1024, 1) for k, v in fields.items()}


def scan(path: Path, tokenizer: str, rows: int, max_seq_len: int, profile: str | None) -> dict:
    from engine.api import RunConfig
    from engine.data.preview import _raw
    from engine.data.scan import xray_scan

    tok = _tokenizer(tokenizer)
    data = {"source": str(path), "max_seq_len": max_seq_len}
    if rows:
        data["max_examples"] = rows
    cfg = RunConfig.from_dict({"data": data}).data
    load_before = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    _raw(cfg)  # read the file into Arrow (memoized: the scan below reads the same table)
    t1, c1 = time.perf_counter(), time.process_time()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        x = prof.runcall(xray_scan, cfg, tok)
        prof.dump_stats(profile)
    else:
        x = xray_scan(cfg, tok)
    secs, cpu = time.perf_counter() - t1, time.process_time() - c1
    out = {
        "tokenizer": tokenizer,
        "rows": x.rows,
        "load_file_s": round(t1 - t0, 1),
        "load_file_cpu_s": round(c1 - c0, 1),
        "scan_s": round(secs, 1),
        "scan_cpu_s": round(cpu, 1),
        "rows_per_s": round(x.rows / secs, 1),
        "rows_per_cpu_s": round(x.rows / cpu, 1),
        "findings": {k: n for k, n in x.counts().items() if n},
        "lengths": len(x.lengths),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # Now, after the scan: the process's own memory apart from the file pages it mapped (the Arrow
        # table is a memory-mapped file the kernel may drop, yet counted in the peak above).
        **_rss_now(),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "cpus": len(os.sched_getaffinity(0)),
    }
    print(json.dumps(out))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the big chat file")
    m.add_argument("path", type=Path)
    m.add_argument("--rows", type=int, default=ROWS)
    s = sub.add_parser("scan", help="X-ray a file and print rows/s and peak RSS")
    s.add_argument("path", type=Path)
    s.add_argument("--tokenizer", default="demo", help="'demo' or a conformance family (qwen3, llama-3.1 ...)")
    s.add_argument("--rows", type=int, default=0, help="the first N rows (0: all)")
    s.add_argument("--max-seq-len", type=int, default=2048)
    s.add_argument("--profile", help="write cProfile stats here")
    a = p.parse_args(argv)
    if a.cmd == "make":
        size = make(a.path, a.rows)
        print(f"{a.path}: {a.rows:,} rows, {size / 1e6:.1f} MB")
    else:
        scan(a.path, a.tokenizer, a.rows, a.max_seq_len, a.profile)


if __name__ == "__main__":
    main()
