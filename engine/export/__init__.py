"""Export a run's result: the registry of export kinds and the one flow that runs them.

`src` is a run folder (its final `adapter/`, else its latest checkpoint), a checkpoint folder or
an adapter folder (engine.runs knows the layout). Each kind is an `ExportKind` in `EXPORTERS`:
its name, how it writes into an empty folder, what it needs installed, and how the written
folder is checked. `run_exports(src, {kind: destination})` is the whole flow, for the CLI
(`tunesmith export RUN --adapter DIR --merged DIR`) and the Export page alike:

1. resolve the source (its adapter, and the run's config when a kind needs the base model);
2. before anything is written, refuse an unknown kind, a missing requirement, two kinds aimed at
   one folder, or a destination that is not empty (unless `overwrite`);
3. per kind: write into `.<name>.partial` beside the destination, run the kind's check on it,
   then rename it into place, so an interrupted or failed export never leaves something that
   looks complete; the run folder gets `exports/<kind>.json`, a report of what was written.

Kinds today: "adapter" (engine/export/adapter.py) and "merged" (engine/export/merged.py).
A new kind (GGUF, ...) is a module here with a `KIND` and one line in `EXPORTERS`.
"""

from __future__ import annotations

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
class ExportKind:
    name: str  # the registry key, the CLI option (--<name>) and the sub-folder when several go to one folder
    title: str  # "adapter", "merged model": "<title> written to DIR"
    label: str  # the Export page's checkbox
    help: str  # the CLI option's help
    stage: str  # the progress line when this kind starts
    write: Callable[..., None]  # write(source, out_dir, progress, **options): fills an empty folder
    check: Callable[[Path], None]  # check(folder): raises ExportError when the folder is not right
    requires: tuple[str, ...] = ()  # modules that must be importable

    def missing(self) -> list[str]:
        """The required modules that are not installed."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _registry() -> dict[str, ExportKind]:
    from engine.export import adapter, merged

    return {k.name: k for k in (adapter.KIND, merged.KIND)}


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


def _check_destination(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"{dst} is a file; choose a folder")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ExportError(f"{dst} already exists and is not empty; choose another folder")


def _atomic_dir(dst: Path, overwrite: bool) -> Path:
    _check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, dst: Path) -> list[str]:
    if dst.exists():
        shutil.rmtree(dst)
    runs.publish(tmp, dst)  # the rename, with normal file permissions (safetensors writes 0600)
    return sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())


def _report(source: ExportSource, kind: ExportKind, dst: Path, files: list[str]) -> None:
    """exports/<kind>.json in the run folder: what was exported where. Best effort: a read-only
    run folder still exports."""
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
    path = run.export_report(kind.name)
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + runs.TMP_SUFFIX)
        tmp.write_text(json.dumps(report, indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


# -- the flow ----------------------------------------------------------------------------------
def _kinds(names) -> list[ExportKind]:
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ExportError(f"unknown export kind '{unknown[0]}' (known: {', '.join(EXPORTERS)})")
    return [EXPORTERS[n] for n in EXPORTERS if n in names]  # registry order: cheap kinds first


def _preflight(requests: Mapping[str, Path], overwrite: bool) -> None:
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
        _check_destination(dst, overwrite)


def _export_one(
    kind: ExportKind, source: ExportSource, dst: Path, overwrite: bool, progress: Progress, **options
) -> list[str]:
    if progress:
        progress(kind.stage)
    tmp = _atomic_dir(dst, overwrite)
    try:
        kind.write(source, tmp, progress, **options)
        if progress:
            progress(f"checking the {kind.title}")
        kind.check(tmp)
        files = _commit(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress(f"{kind.title} written to {dst}: {', '.join(files)}")
    _report(source, kind, dst, files)
    return files


def run_exports(
    src: str | Path, requests: Mapping[str, str | Path], overwrite: bool = False, progress: Progress = None
) -> dict[str, list[str]]:
    """Run the requested exports ({kind: destination folder}) of `src`, in registry order.

    Returns {destination: files written (relative paths)}. Raises ExportError (or
    FileNotFoundError from a loader) with a message for the person; nothing is written unless
    every request passed the checks of step 2 above."""
    requests = {name: Path(dst) for name, dst in requests.items()}
    if not requests:
        raise ExportError(f"nothing to export: choose {' and/or '.join(EXPORTERS)}")
    kinds = _kinds(list(requests))
    source = ExportSource.resolve(src)
    _preflight(requests, overwrite)
    return {str(requests[k.name]): _export_one(k, source, requests[k.name], overwrite, progress) for k in kinds}


def export_adapter(src, dst, overwrite: bool = False, progress: Progress = None) -> list[str]:
    """Copy the PEFT adapter (config, safetensors weights, tokenizer files). Returns files written."""
    return run_exports(src, {"adapter": dst}, overwrite=overwrite, progress=progress)[str(Path(dst))]


def export_merged(src, dst, dtype: str = "auto", overwrite: bool = False, progress: Progress = None) -> list[str]:
    """Merge the adapter into its base model and save 16-bit safetensors that transformers loads."""
    kind = EXPORTERS["merged"]
    dst = Path(dst)
    source = ExportSource.resolve(src)
    _preflight({"merged": dst}, overwrite)
    return _export_one(kind, source, dst, overwrite, progress, dtype=dtype)


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
