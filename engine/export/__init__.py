"""Export a run's result: the registry of export kinds and the one flow that runs them.

`src` is a run folder (its final `adapter/`, else its latest checkpoint), a checkpoint folder or
an adapter folder (engine.runs knows the layout). Each kind is an `ExportKind` in `EXPORTERS`:
its name, how it writes into an empty folder, its options (`ExportOption`: a GGUF's
quantization), what it needs installed (and how to install it), how the written folder is
checked and the self-check's limits it must reach (`thresholds`), which kind's output it can
build on, and what to say after it (notes, a command to run next). `run_exports(src, {kind:
destination})` is the whole flow, for the CLI (`tunesmith export RUN --adapter DIR --merged DIR
--gguf OUT.gguf --quant q8_0`: one option per kind and per kind's option) and the Export page
(one checkbox per kind, one list per option) alike; neither names a kind:

1. resolve the source (its adapter, and the run's config when a kind needs the base model);
2. before anything is written, refuse an unknown kind, a missing requirement, two kinds aimed at
   one folder, or a destination that is not empty (unless `overwrite`);
3. per kind: write into `.<name>.partial` beside the destination, run the kind's check on it,
   then its self-check (engine/export/selfcheck.py: the artefact loaded in its own runtime and
   compared with the trained model), then rename it into place, so an interrupted or failed
   export never leaves something that looks complete; the run folder gets `exports/<kind>.json`
   (what was written) and the self-check's verdict per kind, pass or fail (runs.EXPORT_VERDICTS).

Kinds today: "adapter" (adapter.py), "merged" (merged.py) and "gguf" (gguf.py, with an Ollama
Modelfile from modelfile.py). A new kind is a module here with a `KIND` and its module in
`_KIND_MODULES` (registry order: cheap kinds first, a kind after the one it builds on). Before
anything is written the flow also checks the disk (`check_disk`: one sentence naming the disk,
the space needed and the space free).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from engine import runs

Progress = Optional[Callable[[str], None]]


class ExportError(RuntimeError):
    """An export cannot run or did not produce what it should; the message says why."""


# -- the source --------------------------------------------------------------------------------
def find_adapter(src: str | Path) -> Path:
    """The adapter folder inside a run folder, a checkpoint folder, or an adapter folder itself."""
    src = Path(src)
    if not src.exists():
        raise ExportError(f"{src} does not exist")
    adapter = runs.adapter_in(src)
    if adapter is None:
        raise ExportError(f"{src} holds no adapter (no {' + '.join(runs.ADAPTER_FILES)})")
    return adapter


def run_config_for(adapter_dir: str | Path):
    """The RunConfig of the run an adapter belongs to (walks up to the run's config.yaml), or None."""
    from engine.config import RunConfig

    path = runs.config_for(adapter_dir)
    return RunConfig.load(path) if path is not None else None


@dataclass
class ExportSource:
    """What an export reads: the folder asked for, its adapter, and (on demand) the run config."""

    path: Path
    adapter: Path
    _config: Any = field(default=None, repr=False)

    @classmethod
    def resolve(cls, src: str | Path) -> "ExportSource":
        return cls(Path(src), find_adapter(src))

    def config(self):
        """The run's RunConfig; ExportError when there is none (the base model is then unknown)."""
        if self._config is None:
            self._config = run_config_for(self.adapter)
            if self._config is None:
                raise ExportError(
                    f"cannot find the run's config.yaml above {self.adapter}, so the base model is unknown"
                )
        return self._config


# -- the registry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportOption:
    """A choice a kind takes: the keyword its write, verify, estimate and published get, the
    CLI's --<name> and the Export page's list beside the kind's checkbox. The first choice is
    the default."""

    name: str
    choices: tuple[str, ...]
    help: str  # the CLI's help and the page's tooltip

    @property
    def default(self) -> str:
        return self.choices[0]


@dataclass(frozen=True)
class ExportKind:
    name: str  # the registry key, the CLI option (--<name>) and the sub-folder when several go to one folder
    title: str  # "adapter", "merged model": "<title> written to DIR"
    label: str  # the Export page's checkbox
    help: str  # the CLI option's help
    stage: str  # the progress line when this kind starts
    write: Callable[..., None]  # write(source, out_dir, progress, **options): fills an empty folder
    check: Callable[[Path], None]  # check(folder): raises ExportError when the folder is not right
    requires: tuple[str, ...] = ()  # modules that must be importable
    # verify(folder, source, reference, progress, **options) -> selfcheck.Verdict: the artefact
    # loaded in its own runtime and compared with the trained model (engine/export/selfcheck.py).
    verify: Optional[Callable[..., Any]] = None
    # estimate(source, **options) -> bytes written at the peak (None: unknown), for the disk check.
    estimate: Optional[Callable[..., Optional[int]]] = None
    # Other things it needs besides modules (e.g. llama.cpp's converter script), as sentences.
    also_missing: Optional[Callable[[], list[str]]] = None
    # refuses(source, **options) -> why this run cannot be exported as this kind (one sentence), or
    # None: asked before anything of any kind is written (a Gemma-2 GGUF without tokenizer.model).
    refuses: Optional[Callable[..., Optional[str]]] = None
    # A destination ending in this suffix is a file (X.gguf) written with its companions beside it.
    file_suffix: str = ""
    # companions(dst): the names of the files written beside a file destination dst (its Modelfile),
    # given to write as `companions`: a name that depends on what the folder already holds.
    companions: Optional[Callable[[Path], tuple[str, ...]]] = None
    # published(dst, source, extras, **options): fill in what is known once the artefact is in place
    # (the Modelfile's path and the `ollama create` command).
    published: Optional[Callable[..., None]] = None
    options: tuple[ExportOption, ...] = ()
    # What the self-check must reach (selfcheck.Thresholds), keyed by the value of the kind's first
    # option ("" for a kind without options): a GGUF's limits depend on its quantization.
    thresholds: Mapping[str, Any] = field(default_factory=dict)
    # The kind whose output this one reads when both are asked for in one flow (the GGUF converts
    # the checked merged folder instead of merging again): write and estimate get it as `built_on`.
    builds_on: str = ""
    pushable: bool = False  # its folder is what `tunesmith export --push` sends to the Hugging Face Hub
    # After a successful export, from what write and published put in `extras`: sentences worth
    # saying (notes) and a command to run next, introduced as "for <next_command_for>".
    notes: Optional[Callable[[dict], list[str]]] = None
    next_command: Optional[Callable[[dict], str]] = None
    next_command_for: str = ""
    # install(progress): installs what `missing()` names from within the app (None: cannot).
    install: Optional[Callable[..., Any]] = None
    install_label: str = ""  # the Export page's button
    install_help: str = ""  # its tooltip
    install_stage: str = ""  # the progress line while it runs

    def missing(self) -> list[str]:
        """The required modules (and other things) that are not installed."""
        out = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if self.also_missing is not None and not out:
            out += self.also_missing()
        return out

    def defaults(self) -> dict[str, str]:
        """{option: its default choice}."""
        return {o.name: o.default for o in self.options}

    def limits(self, **options):
        """The selfcheck.Thresholds an artefact written with `options` must reach."""
        key = str(options.get(self.options[0].name, self.options[0].default)) if self.options else ""
        if key not in self.thresholds:
            raise ExportError(f"the {self.title} export has no self-check limits for {key or 'its artefact'}")
        return self.thresholds[key]


# The kind modules, in registry order: cheap kinds first, a kind after the one it builds on.
_KIND_MODULES = ("adapter", "merged", "gguf")


def _registry() -> dict[str, ExportKind]:
    import importlib

    kinds = [importlib.import_module(f"engine.export.{m}").KIND for m in _KIND_MODULES]
    out: dict[str, ExportKind] = {}
    for kind in kinds:
        assert not kind.builds_on or kind.builds_on in out, f"{kind.name} builds on a kind registered after it"
        out[kind.name] = kind
    return out


EXPORTERS: dict[str, ExportKind] = {}  # filled below, once the kind modules can import this one


def destinations(folder: str | Path, kinds: list[str]) -> dict[str, Path]:
    """Where each kind goes when several share one folder: the folder itself for one kind,
    `<folder>/<kind>` for each of several (what the Export page writes)."""
    folder = Path(folder)
    if len(kinds) == 1:
        return {kinds[0]: folder}
    return {k: folder / k for k in kinds}


# -- atomic folders ----------------------------------------------------------------------------
def _partial(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.partial")


def _is_file_target(kind: ExportKind, dst: Path) -> bool:
    return bool(kind.file_suffix) and dst.suffix.lower() == kind.file_suffix


def _check_destination(dst: Path, overwrite: bool, kind: Optional[ExportKind] = None) -> None:
    if kind is not None and _is_file_target(kind, dst):
        if dst.is_dir():
            raise ExportError(f"{dst} is a folder; name a {kind.file_suffix} file or a folder without the suffix")
        for p in (dst, *(dst.parent / c for c in (kind.companions(dst) if kind.companions else ()))):
            if p.exists() and not overwrite:
                raise ExportError(f"{p} already exists; choose another name or overwrite")
        return
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"{dst} is a file; choose a folder")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ExportError(f"{dst} already exists and is not empty; choose another folder")


def _atomic_dir(dst: Path, overwrite: bool, kind: Optional[ExportKind] = None) -> Path:
    _check_destination(dst, overwrite, kind)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, dst: Path, kind: Optional[ExportKind] = None) -> list[str]:
    if kind is not None and _is_file_target(kind, dst):
        # The companions first, the artefact itself last: once X.gguf is there, all of it is.
        names = sorted((p.name for p in tmp.iterdir() if p.is_file()), key=lambda n: n == dst.name)
        for name in names:
            runs.publish(tmp / name, dst.parent / name)
        shutil.rmtree(tmp, ignore_errors=True)
        return names
    if dst.exists():
        shutil.rmtree(dst)
    runs.publish(tmp, dst)  # the rename, with normal file permissions (safetensors writes 0600)
    return sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())


# -- reports in the run folder -----------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    """Best effort: a read-only run folder still exports."""
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + runs.TMP_SUFFIX)
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def _report(source: ExportSource, kind: ExportKind, dst: Path, files: list[str]) -> None:
    """exports/<kind>.json in the run folder: what was exported where."""
    run = runs.RunFolder.of(source.adapter)
    if not run.is_run():
        return
    report = {
        "kind": kind.name,
        "source": str(source.adapter),
        "destination": str(dst.resolve()),
        "files": files,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    _write_json(run.export_report(kind.name), report)


def report_path(src: str | Path) -> Path:
    """The self-check verdicts (runs.EXPORT_VERDICTS) of the run that `src` (a run, checkpoint or
    adapter folder) belongs to."""
    return runs.RunFolder.of(src).export_verdicts


def read_export_report(src: str | Path) -> dict:
    """{kind: verdict dict} of the last export of each kind of a run ({} when none)."""
    try:
        return json.loads(report_path(src).read_text(encoding="utf-8")).get("exports", {})
    except (OSError, ValueError, AttributeError):
        return {}


def _record_verdict(source: ExportSource, verdict) -> None:
    run = runs.RunFolder.of(source.adapter)
    if not run.is_run():
        return
    path = run.export_verdicts
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data.setdefault("exports", {})[verdict.kind] = {**verdict.to_dict(), "source": str(source.adapter)}
    data["run"] = str(run.path)
    _write_json(path, data)


# -- disk space --------------------------------------------------------------------------------
def disk_free(path: Path) -> int:
    """Free bytes on the disk that holds `path` (its nearest existing parent)."""
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return shutil.disk_usage(Path.cwd()).free


def mount_point(path: Path) -> Path:
    p = next((q for q in (path, *path.parents) if q.exists()), Path("/")).resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def _gb(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e5:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} bytes"


def check_disk(needs: Mapping[Path, int]) -> None:
    """One sentence before anything is written when a disk cannot hold what goes to it."""
    per_disk: dict[Path, int] = {}
    for dst, size in needs.items():
        per_disk[mount_point(dst)] = per_disk.get(mount_point(dst), 0) + size
    for mount, size in per_disk.items():
        free = disk_free(mount)
        if size > free:
            raise ExportError(
                f"not enough disk space on the disk mounted at {mount}: the export needs about {_gb(size)} "
                f"and {_gb(free)} is free"
            )


# -- the flow ----------------------------------------------------------------------------------
class SelfCheckFailed(ExportError):
    """An export was written but its self-check failed; nothing was published. `.verdicts` holds
    every verdict of the flow so far, the failed one last."""

    def __init__(self, message: str, verdicts: list):
        super().__init__(message)
        self.verdicts = verdicts


@dataclass
class ExportResult:
    written: dict[str, list[str]]  # {destination: files}, as run_exports returns
    verdicts: list = field(default_factory=list)  # selfcheck.Verdict per kind, in registry order
    extras: dict[str, dict] = field(default_factory=dict)  # per kind: e.g. the Modelfile and ollama command


def _options_for(kind: ExportKind, requests: Mapping[str, Path], options: Optional[Mapping[str, dict]]) -> dict:
    """The keyword arguments of one kind's calls: its options' defaults, what was asked, and the
    destination of the kind it builds on when that is in the same flow (written and checked
    before it: registry order)."""
    opts = {**kind.defaults(), **dict((options or {}).get(kind.name, {}))}
    if kind.builds_on in requests:
        opts["built_on"] = requests[kind.builds_on]
    return opts


def _kinds(names) -> list[ExportKind]:
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ExportError(f"unknown export kind '{unknown[0]}' (known: {', '.join(EXPORTERS)})")
    return [EXPORTERS[n] for n in EXPORTERS if n in names]  # registry order: cheap kinds first


def _preflight(
    requests: Mapping[str, Path],
    overwrite: bool,
    source: Optional[ExportSource] = None,
    options: Optional[Mapping[str, dict]] = None,
) -> None:
    for kind in _kinds(list(requests)):
        missing = kind.missing()
        if missing:
            raise ExportError(f"the {kind.title} export needs {', '.join(missing)} installed")
    seen: dict[Path, str] = {}
    for name, dst in requests.items():
        key = dst.expanduser().resolve()
        if key in seen:
            raise ExportError(f"the {seen[key]} and {name} exports need different folders (both go to {dst})")
        seen[key] = name
        _check_destination(dst, overwrite, EXPORTERS[name])
    if source is not None:
        for kind in _kinds(list(requests)):
            why = kind.refuses(source, **_options_for(kind, requests, options)) if kind.refuses else None
            if why:
                raise ExportError(why)
        needs = {}
        for kind in _kinds(list(requests)):
            opts = _options_for(kind, requests, options)
            size = kind.estimate(source, **opts) if kind.estimate else None
            if size:
                needs[requests[kind.name]] = size
        check_disk(needs)


def _export_one(
    kind: ExportKind,
    source: ExportSource,
    dst: Path,
    overwrite: bool,
    progress: Progress,
    reference=None,
    verdicts: Optional[list] = None,
    **options,
) -> list[str]:
    """Write one kind into its .partial folder, check its files, run its self-check against
    `reference` (None: no self-check), then publish it. A failed check removes the partial folder
    and raises; the verdict, pass or fail, goes to the run's runs.EXPORT_VERDICTS."""
    if progress:
        progress(kind.stage)
    tmp = _atomic_dir(dst, overwrite, kind)
    if _is_file_target(kind, dst):
        options["filename"] = dst.name
        options["companions"] = kind.companions(dst) if kind.companions else ()
    try:
        kind.write(source, tmp, progress, **options)
        if progress:
            progress(f"checking the {kind.title}")
        kind.check(tmp)
        if reference is not None and kind.verify is not None:
            if progress:
                progress(f"self-check: loading the {kind.title} in its own runtime")
            v = _verify(kind, tmp, dst, source, reference, progress, options)
            if verdicts is not None:
                verdicts.append(v)
            _record_verdict(source, v)
            if progress:
                progress(f"{kind.title}: {v.summary}")
            if not v.ok:
                raise SelfCheckFailed(
                    f"the {kind.title} failed its self-check, so it was not written: {v.reasons[0]}",
                    list(verdicts or [v]),
                )
        files = _commit(tmp, dst, kind)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:  # the estimate fell short: still one sentence, not the errno text
            raise ExportError(
                f"the disk mounted at {mount_point(dst)} filled up while the {kind.title} was being written "
                f"({_gb(disk_free(dst))} free now); nothing was left behind"
            ) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress(f"{kind.title} written to {dst}: {', '.join(files)}")
    _report(source, kind, dst, files)
    return files


def _verify(kind: ExportKind, tmp: Path, dst: Path, source: ExportSource, reference, progress, options):
    from engine.export import selfcheck

    final = dst if not _is_file_target(kind, dst) else dst
    try:
        v = kind.verify(tmp, source, reference, progress, **options)
    except ExportError:
        raise
    except Exception as exc:  # the check itself could not run: the export is not verified
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        v = selfcheck.failed(kind.name, final, f"the self-check could not run: {text}")
    v.artefact = str(final)
    return v


def export_and_check(
    src: str | Path,
    requests: Mapping[str, str | Path],
    overwrite: bool = False,
    progress: Progress = None,
    options: Optional[Mapping[str, dict]] = None,
    verify: bool = True,
) -> ExportResult:
    """Run the requested exports ({kind: destination}) of `src` in registry order, each
    self-checked (`verify`) before it is published. `options`: per kind keyword arguments,
    e.g. {"gguf": {"quant": "q4_k_m"}}. Raises ExportError before anything is written for a
    bad request, a missing requirement or a full disk; SelfCheckFailed (an ExportError, with
    `.verdicts`) when an artefact does not behave like the trained model."""
    requests = {name: Path(dst) for name, dst in requests.items()}
    if not requests:
        raise ExportError(f"nothing to export: choose {' and/or '.join(EXPORTERS)}")
    kinds = _kinds(list(requests))
    source = ExportSource.resolve(src)
    options = {k: dict(v) for k, v in (options or {}).items()}
    _preflight(requests, overwrite, source, options)
    reference = None
    if verify:
        from engine.export.selfcheck import Reference

        reference = Reference(source, progress)
    result = ExportResult({})
    for kind in kinds:
        opts = _options_for(kind, requests, options)
        opts["extras"] = result.extras.setdefault(kind.name, {})
        dst = requests[kind.name]
        result.written[str(dst)] = _export_one(
            kind, source, dst, overwrite, progress, reference=reference, verdicts=result.verdicts, **opts
        )
        if kind.published is not None:
            kind.published(dst, source, opts["extras"], **{k: v for k, v in opts.items() if k != "extras"})
        if not result.extras[kind.name]:
            del result.extras[kind.name]
    return result


def run_exports(
    src: str | Path,
    requests: Mapping[str, str | Path],
    overwrite: bool = False,
    progress: Progress = None,
    options: Optional[Mapping[str, dict]] = None,
    verify: bool = True,
) -> dict[str, list[str]]:
    """`export_and_check`, returning {destination: files written (relative paths)} only."""
    return export_and_check(src, requests, overwrite, progress, options, verify).written


def export_adapter(src, dst, overwrite: bool = False, progress: Progress = None, verify: bool = True) -> list[str]:
    """Copy the PEFT adapter (config, safetensors weights, tokenizer files). Returns files written."""
    return run_exports(src, {"adapter": dst}, overwrite=overwrite, progress=progress, verify=verify)[str(Path(dst))]


def export_merged(
    src, dst, dtype: str = "auto", overwrite: bool = False, progress: Progress = None, verify: bool = True
) -> list[str]:
    """Merge the adapter into its base model and save 16-bit safetensors that transformers loads."""
    return run_exports(
        src,
        {"merged": dst},
        overwrite=overwrite,
        progress=progress,
        options={"merged": {"dtype": dtype}},
        verify=verify,
    )[str(Path(dst))]


# -- checks shared by the kinds ----------------------------------------------------------------
def check_safetensors(path: Path) -> dict:
    """The header of a safetensors file (its tensors' names, dtypes and shapes); ExportError when
    the file is not one. Reads the header only, with no torch."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if size <= 0 or size > path.stat().st_size - 8:
                raise ExportError(f"{path.name} is not a safetensors file (bad header size)")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path.name} is not a readable safetensors file: {exc}") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise ExportError(f"{path.name} holds no tensors")
    return tensors


def check_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path.name} is missing") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path.name} is not readable JSON: {exc}") from None


EXPORTERS.update(_registry())
