"""The headless command line: `tunesmith train | export | chat | hw | demo` (also `python -m engine`).

The window (`tunesmith` with no subcommand) lives in studio.cli, which hands every
subcommand to `main` here, so the CLI and the GUI drive the same engine API: this module uses
engine.api's names only, as the window does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from engine.api import (
    DEMO_PRESET,
    EXPORTERS,
    VERSION,
    ChatError,
    CheckpointSaved,
    ConfigError,
    ExportError,
    Failed,
    Finished,
    LogLine,
    RunConfig,
    RunStarted,
    SelfCheckFailed,
    StepMetrics,
    detect,
    export_and_check,
    format_profile,
    push_to_hub,
)

# The method's own figures a step line adds (StepMetrics.metrics, TRL's names), in this order.
STEP_FIGURES = (
    ("reward", "reward"),
    ("reward_std", "±"),
    ("kl", "kl"),
    ("rewards/margins", "margin"),
    ("rewards/accuracies", "acc"),
    ("completion_length", "len"),
)


def _method_figures(metrics: dict | None) -> str:
    """'  reward 0.41 ± 0.32  kl 0.002': what tells a DPO or GRPO run's progress (its loss alone
    does not: GRPO's is beta x KL); nothing for SFT."""
    shown = [f"{word} {metrics[key]:.3g}" for key, word in STEP_FIGURES if key in (metrics or {})]
    return ("  " + "  ".join(shown)).replace("  ± ", " ± ") if shown else ""


def _print_event(event) -> None:
    if isinstance(event, StepMetrics):
        mem = event.mem_peak / 2**30
        print(
            f"step {event.step}/{event.total_steps}  loss {event.loss:.4f}  lr {event.lr:.2e}  "
            f"grad {event.grad_norm:.3f}  {event.tokens_per_second:,.0f} tok/s  "
            f"{event.step_seconds * 1000:.0f} ms  mem {mem:.2f} GiB" + _method_figures(event.metrics),
            flush=True,
        )
    elif isinstance(event, LogLine):
        print(f"[{event.level}] {event.message}", file=sys.stderr if event.level == "error" else sys.stdout, flush=True)
    elif isinstance(event, RunStarted):
        print(f"run started: {event.run_dir} ({event.total_steps} steps)", flush=True)
    elif isinstance(event, CheckpointSaved):
        print(f"checkpoint: {event.path}", flush=True)
    elif isinstance(event, Finished):
        summary = ", ".join(f"{k}={v}" for k, v in event.summary.items())
        print(("stopped: " if event.stopped else "finished: ") + summary, flush=True)
    elif isinstance(event, Failed):
        print(f"FAILED: {event.message}", file=sys.stderr, flush=True)


def _print_json_event(event) -> None:
    """--events-json: every event as one JSON line on stdout (the window reads a multi-process
    run this way; under torchrun only rank 0 reports)."""
    print(json.dumps(event.to_dict(), default=str), flush=True)


def _train(config, output, resume, events_json: bool = False) -> int:
    from engine.api import TrainingSession, apply_cpu_threads

    report = _print_json_event if events_json else _print_event
    threads = apply_cpu_threads(config.training.device)
    if threads is not None and os.environ.get("RANK", "0") == "0":  # rank 0 speaks for all
        report(LogLine(message=f"torch uses {threads.reason}"))
    session = TrainingSession(config, report, run_dir=output, resume_from=resume)

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
    try:
        config = RunConfig.load(args.config)
        if args.max_steps is not None:
            config.training.max_steps = args.max_steps
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.gpus is not None and args.gpus > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, config)
    return _train(config, args.output, args.resume, args.events_json)


def _launch(args, config) -> int:
    """`--gpus N`: the same command under torchrun, one process per GPU (gloo processes on a
    machine without CUDA). The run folder is fixed here so every rank and the caller agree."""
    import subprocess

    from engine.api import DistContext, launch_command, new_run_folder, visible_gpus

    n = args.gpus
    gpus = visible_gpus()
    if gpus and n > gpus:
        print(
            f"error: --gpus {n}, but this machine shows {gpus} CUDA {'GPU' if gpus == 1 else 'GPUs'}", file=sys.stderr
        )
        return 2
    why = DistContext(0, n, 0).check_plan(config.training.grad_accum)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    output = args.output
    if output is None and args.resume is None:
        folder, note = new_run_folder(config.output.dir, config.output.run_name, config.output.overwrite)
        output = str(folder.path)
        if note:
            print(note, flush=True)
    engine_args = ["train", args.config]
    for flag, value in (("--output", output), ("--resume", args.resume), ("--max-steps", args.max_steps)):
        if value is not None:
            engine_args += [flag, str(value)]
    if args.events_json:
        engine_args.append("--events-json")
    if not gpus:
        print(f"no CUDA GPU: {n} CPU processes (gloo)", file=sys.stderr, flush=True)
    cmd = launch_command(n, engine_args)
    # torchrun forwards Ctrl+C to every rank; they agree to stop after the step and rank 0
    # saves a checkpoint. Here Ctrl+C only waits for that. A SIGTERM (the window closing, a
    # job scheduler) is passed on, so torchrun ends its ranks and nothing is left running.
    proc = subprocess.Popen(cmd)
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM)),
    }
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc != 0:
        where = output or args.resume
        print(
            f"error: a training process ended with status {rc}, so the run stopped on every GPU "
            f"(its own error is above). The checkpoints in {where} are intact: continue with "
            f"`tunesmith train {args.config} --resume {where} --gpus {n}`.",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_demo(args) -> int:
    """The built-in demo fine-tune, headless."""
    config = RunConfig.load(DEMO_PRESET)
    output = Path(args.output) if args.output else None
    if output is None:
        config.output.run_name = "auto"
    rc = _train(config, output, None)
    return rc


def _export_options(args, requests) -> dict[str, dict]:
    """{kind: {option: value}} of the requested kinds that take options."""
    return {
        name: {o.name: getattr(args, o.name) for o in EXPORTERS[name].options}
        for name in requests
        if EXPORTERS[name].options
    }


def cmd_export(args) -> int:
    """Every kind in the export registry is an option (--adapter DIR, --merged DIR, --gguf OUT.gguf),
    and so is every kind's own option (--quant); each export is self-checked against the trained
    model before it is published, and the verdicts are printed (and written to the run folder)."""
    requests = {name: getattr(args, name) for name in EXPORTERS if getattr(args, name, None)}
    if not requests:
        options = " and/or ".join(
            f"--{k.name} {'OUT' + k.file_suffix if k.file_suffix else 'DIR'}" for k in EXPORTERS.values()
        )
        print(f"error: say what to export: {options}", file=sys.stderr)
        return 2
    options = _export_options(args, requests)
    try:
        result = export_and_check(args.run, requests, overwrite=args.overwrite, progress=print, options=options)
    except SelfCheckFailed as exc:
        for v in exc.verdicts:
            print(f"self-check {v.kind}: {v.summary}", file=sys.stderr if not v.ok else sys.stdout)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ExportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for v in result.verdicts:
        print(f"self-check {v.kind}: {v.summary}")
    for name, extras in result.extras.items():
        kind = EXPORTERS[name]
        for note in kind.notes(extras) if kind.notes else []:
            print(note)
        command = kind.next_command(extras) if kind.next_command else ""
        if command:
            print(f"for {kind.next_command_for}: {command}")
    if args.push:
        # The last pushable kind asked for, in registry order: the merged model, else the adapter.
        kind = next((k.name for k in reversed(EXPORTERS.values()) if k.pushable and k.name in requests), None)
        if kind is None:
            pushable = " or ".join(f"--{k.name}" for k in EXPORTERS.values() if k.pushable)
            print(f"error: --push needs {pushable} (the folder that is pushed)", file=sys.stderr)
            return 2
        try:
            print(f"pushed to {push_to_hub(requests[kind], args.push, args.run, kind, progress=print)}")
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


CHAT_HELP = "/reset starts the conversation over; /quit (or Ctrl-D) ends it"


def cmd_chat(args) -> int:
    """Talk to a run's result in the terminal: its base model with the run's adapter (or, with
    --base, the base alone), through the model's chat template as training rendered it. One reply
    with --prompt; otherwise a conversation read line by line from the terminal (or a pipe)."""
    from engine.api import RunChat, load_tools, template_uses_tools

    try:
        tools = load_tools(args.tools) if args.tools else None
        if args.max_new_tokens < 1:
            raise ChatError(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
        chat = RunChat(args.run, device=args.device)
    except ChatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tools and not template_uses_tools(chat.tokenizer):
        print(f"warning: {chat.base_name}'s chat template has no tools; --tools is not in the prompt", file=sys.stderr)
    which = "the base model alone (adapter off)" if args.base else f"adapter {chat.adapter_dir}"
    opening = [{"role": "system", "content": args.system}] if args.system else []

    def reply(messages, on_text=None):
        return chat.reply(
            messages,
            args.max_new_tokens,
            use_adapter=not args.base,
            tools=tools,
            temperature=args.temperature,
            on_text=on_text,
        )

    if args.prompt is not None:
        try:
            print(reply(opening + [{"role": "user", "content": args.prompt}]))
        except KeyboardInterrupt:
            return 130
        return 0
    interactive = sys.stdin.isatty()
    stream = interactive and sys.stdout.isatty()  # a terminal sees the reply as it is made
    if interactive:
        print(f"{chat.base_name} + {which} on {chat.device}. {CHAT_HELP}.")
    messages = list(opening)
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: the end
            if interactive:
                print()
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            messages = list(opening)
            print("(a new conversation)")
            continue
        messages.append({"role": "user", "content": text})
        try:
            if stream:
                print("model> ", end="", flush=True)
                shown = []

                def show(piece, shown=shown):
                    print(piece.lstrip() if not shown else piece, end="", flush=True)
                    shown.append(piece)

                answer = reply(messages, show)
                print()
            else:
                answer = reply(messages)
                print(f"model> {answer}" if interactive else answer, flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the conversation
            messages.pop()
            print("\n(stopped; the message is dropped)")
            continue
        messages.append({"role": "assistant", "content": answer})
    return 0


def cmd_hw(args) -> int:
    profile = detect()
    print(format_profile(profile, RunConfig.load(DEMO_PRESET)))
    return 0


def build_parser(more_commands: Sequence[tuple[str, str]] = (), description: str = "") -> argparse.ArgumentParser:
    """The headless commands' parser. `more_commands`: (name, help) of commands another layer runs
    (the console command in studio.cli: the window, doctor, the desktop entry), listed in the help
    and in "invalid choice" errors so a user sees every command in one place; parsing one of
    them here leaves `func` unset."""
    p = argparse.ArgumentParser(
        prog="tunesmith", description=description or "Fast LoRA / QLoRA fine-tuning (headless commands)."
    )
    p.add_argument("--version", action="version", version=f"tunesmith {VERSION}")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train from a YAML run config")
    t.add_argument("config", help="run config (YAML), e.g. resources/presets/demo.yaml")
    t.add_argument("--output", help="run folder (default: output.dir/output.run_name from the config)")
    t.add_argument("--resume", help="resume from a run folder (latest checkpoint) or a checkpoint folder")
    t.add_argument("--max-steps", type=int, help="override training.max_steps")
    t.add_argument(
        "--gpus",
        type=int,
        help="train on N GPUs of this machine (torchrun; DDP, or FSDP2 with training.distributed: fsdp); "
        "without CUDA, N CPU processes",
    )
    t.add_argument("--events-json", action="store_true", help="print every event as a JSON line (for the window)")
    t.set_defaults(func=cmd_train)
    d = sub.add_parser("demo", help="run the built-in demo fine-tune headless")
    d.add_argument("--output", help="run folder")
    d.set_defaults(func=cmd_demo)
    e = sub.add_parser("export", help="export a run's " + " and/or ".join(k.title for k in EXPORTERS.values()))
    e.add_argument("run", help="run folder or checkpoint folder")
    for kind in EXPORTERS.values():
        metavar = f"OUT{kind.file_suffix}" if kind.file_suffix else "DIR"
        e.add_argument(f"--{kind.name}", dest=kind.name, metavar=metavar, help=kind.help)
    for kind in EXPORTERS.values():
        for option in kind.options:
            e.add_argument(
                f"--{option.name}",
                choices=option.choices,
                default=option.default,
                help=f"{option.help} (--{kind.name}; default %(default)s)",
            )
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    pushable = [k.title for k in reversed(EXPORTERS.values()) if k.pushable]
    e.add_argument(
        "--push",
        metavar="USER/REPO",
        help=f"push the {pushable[0]}{''.join(f' (else the {t})' for t in pushable[1:])} to the Hugging Face Hub",
    )
    e.set_defaults(func=cmd_export)
    c = sub.add_parser("chat", help="talk to a run's result in the terminal (base model + the run's adapter)")
    c.add_argument("run", help="run folder or checkpoint folder")
    c.add_argument("--prompt", help="print the reply to this one message and exit (default: a conversation)")
    c.add_argument("--system", help="a system prompt that opens the conversation")
    c.add_argument(
        "--tools",
        metavar="TOOLS.json",
        help="tool definitions the template writes into the prompt (a JSON list, as a training row's tools column)",
    )
    c.add_argument("--base", action="store_true", help="the base model alone, with the adapter switched off")
    c.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default %(default)s)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 picks the likeliest token (default %(default)s)")
    c.add_argument("--device", default="auto", help="auto (the GPU when there is one), cuda or cpu")
    c.set_defaults(func=cmd_chat)
    h = sub.add_parser("hw", help="show the detected hardware and the defaults chosen for it")
    h.set_defaults(func=cmd_hw)
    for name, text in more_commands:
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: list[str] | None = None, more_commands: Sequence[tuple[str, str]] = (), description: str = "") -> int:
    """Run a headless command. `more_commands` and `description`: see build_parser."""
    from engine.api import prefer_expandable_segments

    prefer_expandable_segments()  # this process is ours; before anything initialises CUDA
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(more_commands, description)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
