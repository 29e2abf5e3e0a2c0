"""The headless command line: `tunesmith train | export | hw | demo` (also `python -m engine`).

The window (`tunesmith` with no subcommand) lives in studio.cli, which hands every
subcommand to `main` here, so the CLI and the GUI drive the same engine API.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def _print_event(event) -> None:
    from engine.events import CheckpointSaved, Failed, Finished, LogLine, RunStarted, StepMetrics

    if isinstance(event, StepMetrics):
        mem = event.mem_peak / 2**30
        print(
            f"step {event.step}/{event.total_steps}  loss {event.loss:.4f}  lr {event.lr:.2e}  "
            f"grad {event.grad_norm:.3f}  {event.tokens_per_second:,.0f} tok/s  "
            f"{event.step_seconds * 1000:.0f} ms  mem {mem:.2f} GiB",
            flush=True,
        )
    elif isinstance(event, LogLine):
        print(f"[{event.level}] {event.message}", file=sys.stderr if event.level == "error" else sys.stdout, flush=True)
    elif isinstance(event, RunStarted):
        print(f"run started: {event.run_dir} ({event.total_steps} steps)", flush=True)
    elif isinstance(event, CheckpointSaved):
        print(f"checkpoint: {event.path}", flush=True)
    elif isinstance(event, Finished):
        print(("stopped: " if event.stopped else "finished: ") + ", ".join(f"{k}={v}" for k, v in event.summary.items()), flush=True)
    elif isinstance(event, Failed):
        print(f"FAILED: {event.message}", file=sys.stderr, flush=True)


def _train(config, output, resume) -> int:
    from engine.events import Failed
    from engine.train.session import TrainingSession

    session = TrainingSession(config, _print_event, run_dir=output, resume_from=resume)

    def on_sigint(signum, frame):
        print("\nstopping after this step (a checkpoint will be saved) ...", flush=True)
        session.request_stop()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        result = session.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    return 1 if isinstance(result, Failed) else 0


def cmd_train(args) -> int:
    from engine.config import ConfigError, RunConfig

    try:
        config = RunConfig.load(args.config)
        if args.max_steps is not None:
            config.training.max_steps = args.max_steps
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _train(config, args.output, args.resume)


def cmd_demo(args) -> int:
    """The built-in demo fine-tune, headless, then export its adapter."""
    from engine.config import RunConfig
    from engine.resources import DEMO_PRESET

    config = RunConfig.load(DEMO_PRESET)
    output = Path(args.output) if args.output else None
    if output is None:
        config.output.run_name = "auto"
    rc = _train(config, output, None)
    return rc


def cmd_export(args) -> int:
    from engine.export import ExportError, export_adapter, export_merged

    if not args.adapter and not args.merged:
        print("error: say what to export: --adapter DIR and/or --merged DIR", file=sys.stderr)
        return 2
    try:
        if args.adapter:
            files = export_adapter(args.run, args.adapter, overwrite=args.overwrite, progress=print)
            print(f"adapter written to {args.adapter}: {', '.join(files)}")
        if args.merged:
            files = export_merged(args.run, args.merged, overwrite=args.overwrite, progress=print)
            print(f"merged model written to {args.merged}: {', '.join(files)}")
    except (ExportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_hw(args) -> int:
    from engine.hardware.policy import format_profile
    from engine.hardware.profile import detect
    from engine.config import RunConfig
    from engine.resources import DEMO_PRESET

    profile = detect()
    print(format_profile(profile, RunConfig.load(DEMO_PRESET)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tunesmith", description="Fast LoRA / QLoRA fine-tuning (headless commands).")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train from a YAML run config")
    t.add_argument("config", help="run config (YAML), e.g. resources/presets/demo.yaml")
    t.add_argument("--output", help="run folder (default: output.dir/output.run_name from the config)")
    t.add_argument("--resume", help="resume from a run folder (latest checkpoint) or a checkpoint folder")
    t.add_argument("--max-steps", type=int, help="override training.max_steps")
    t.set_defaults(func=cmd_train)
    d = sub.add_parser("demo", help="run the built-in demo fine-tune headless")
    d.add_argument("--output", help="run folder")
    d.set_defaults(func=cmd_demo)
    e = sub.add_parser("export", help="export a run's adapter and/or a merged 16-bit model")
    e.add_argument("run", help="run folder or checkpoint folder")
    e.add_argument("--adapter", help="folder for the PEFT adapter")
    e.add_argument("--merged", help="folder for the merged 16-bit safetensors model")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    e.set_defaults(func=cmd_export)
    h = sub.add_parser("hw", help="show the detected hardware and the defaults chosen for it")
    h.set_defaults(func=cmd_hw)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
