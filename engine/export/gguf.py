"""The "gguf" export: the merged model converted by llama.cpp's own converter and quantized by
llama.cpp's own quantizer, with an Ollama Modelfile beside it.

How it is written:

1. the merged model in 16 bits (the "merged" export's folder when it is exported in the same
   flow, else a scratch copy in the partial folder, removed afterwards);
2. `convert_hf_to_gguf.py` (llama.cpp's, with the `gguf-py` it shipped with) turns it into a
   16-bit GGUF, in a subprocess (engine/export/_gguf_convert.py);
3. `llama_cpp.llama_model_quantize` makes q8_0 or q4_k_m from it (f16 / bf16 are written by the
   converter directly);
4. `Modelfile` beside it (engine/export/modelfile.py), or `<name>.Modelfile` when the folder's
   `Modelfile` is another GGUF's (several GGUFs exported into one folder: modelfile.modelfile_name).

What it needs (`tunesmith[gguf]`, pinned in pyproject.toml): llama-cpp-python (a C++ build; PyPI
ships it as a source distribution only), gguf, and sentencepiece (the converter imports it).
The converter is not in llama-cpp-python's wheel, only in its source distribution
(vendor/llama.cpp): `fetch_converter()` (run by scripts/install.sh and the Export page's install
button; `python -m engine.export fetch-converter`) extracts `convert_hf_to_gguf.py`,
`conversion/` and `gguf-py/` of the pinned release into `converter_dir()`, so the converter and
the quantizer are the same llama.cpp.

The self-check loads the GGUF with llama.cpp (through llama-cpp-python) and compares it with the
trained model; it also lints the GGUF's metadata (EOS id, the chat template as llama.cpp renders
it, llama.cpp's tokenization of the prompts against the tokenizer's)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from engine.export import ExportError, ExportKind, ExportOption
from engine.export.selfcheck import SIXTEEN_BIT, Thresholds

LLAMA_CPP_PYTHON = "0.3.36"  # keep in step with pyproject.toml's [gguf] extra
GGUF = "0.19.0"
# Each GGUF type with what its self-check must reach, the default first. The quantized types'
# limits were set from the demo model with a wide margin (docs/ENGINE_API.md).
LIMITS = {
    "q8_0": Thresholds(0.93, 0.03, 0.05, "8-bit quantization: close"),
    "q4_k_m": Thresholds(0.80, 0.30, 0.30, "4-bit quantization: at most a 30% perplexity rise"),
    "f16": SIXTEEN_BIT,
    "bf16": SIXTEEN_BIT,
}
QUANTS = tuple(LIMITS)
DEFAULT_QUANT = QUANTS[0]
# Bytes per parameter of each output, for the disk check (q4_k_m keeps some tensors in 6 bits).
_BYTES_PER_PARAM = {"f16": 2.0, "bf16": 2.0, "q8_0": 1.07, "q4_k_m": 0.62}
# Files of the llama.cpp source the converter needs.
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


# -- the converter -----------------------------------------------------------------------------
def converter_dir() -> Path:
    """Where the converter of the pinned llama.cpp lives: $TUNESMITH_LLAMA_CPP_DIR, else
    $XDG_DATA_HOME/tunesmith/llama.cpp-<llama-cpp-python version> (~/.local/share/...)."""
    env = os.environ.get("TUNESMITH_LLAMA_CPP_DIR")
    if env:
        return Path(env).expanduser()
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "tunesmith" / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def converter_missing() -> list[str]:
    if (converter_dir() / "convert_hf_to_gguf.py").is_file() and (converter_dir() / "gguf-py").is_dir():
        return []
    return [f"llama.cpp's converter (`python -m engine.export fetch-converter` puts it in {converter_dir()})"]


def download_sdist(directory: str | Path) -> Path:
    """The pinned llama-cpp-python source distribution, downloaded by pip into `directory` (from
    pip's cache when it built the wheel from it). The converter and the test suite's conformance
    fixtures (llama.cpp's templates and vocabularies) both come from it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(directory), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise ExportError(f"pip could not download llama-cpp-python {LLAMA_CPP_PYTHON}: {out.stderr.strip()[-400:]}")
    return next(Path(directory).glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))


def extract_members(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo]) -> None:
    """Extract `members` (regular files and folders picked by the caller) of `tar` into `dest`.

    Python's "data" filter (no links, nothing outside `dest`, no special files) where the running
    Python has it: Debian 12's stock Python 3.11.2 predates it (3.11.4), and there
    extractall(filter=...) is a TypeError, which turned GGUF export off on a fresh install. There the
    same rules are checked here before extracting."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts:
            raise ExportError(f"{tar.name}: refusing to extract {m.name!r} (not a plain file inside the folder)")
    tar.extractall(dest, members=members)


def fetch_converter(sdist: Optional[str | Path] = None, progress=None) -> Path:
    """Extract the converter of llama-cpp-python's source distribution into converter_dir().
    `sdist`: a llama_cpp_python-<version>.tar.gz already here; else pip downloads the pinned one."""
    dest = converter_dir()
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            if progress:
                progress(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} source for its converter")
            sdist = download_sdist(tmp)
        staging = Path(tmp) / "staging"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)  # llama_cpp_python-X/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"]:
                    rest = parts[3]
                    if any(rest == p or (p.endswith("/") and rest.startswith(p)) for p in _CONVERTER_PARTS):
                        if m.isfile() or m.isdir():
                            m.name = rest
                            members.append(m)
            if not any(m.name == "convert_hf_to_gguf.py" for m in members):
                raise ExportError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
            extract_members(tar, staging, members)
        if progress:
            progress(f"llama.cpp's converter put in {dest}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staging), dest)
    return dest


# -- writing -----------------------------------------------------------------------------------
def _run_converter(merged: Path, outfile: Path, outtype: str, progress) -> None:
    runner = Path(__file__).with_name("_gguf_convert.py")
    cmd = [sys.executable, str(runner), str(converter_dir()), str(merged), "--outfile", str(outfile)]
    cmd += ["--outtype", outtype]
    if progress:
        progress(f"converting to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py")
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "HF_HUB_OFFLINE": "1"}  # gguf-py comes first on sys.path already
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0 or not outfile.is_file():
        tail = [line for line in (out.stderr or out.stdout).strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise ExportError(f"llama.cpp's converter failed on the merged model: {tail[0]}")


@functools.cache
def _llama_cpp():
    """llama-cpp-python, imported on first use. Its `_utils` opens two /dev/null files at import
    (for `verbose=False` loads) and never closes them; at interpreter exit the export process
    printed "sys:1: ResourceWarning: unclosed file <... name='/dev/null' ...>" twice after every GGUF
    export. They are closed at exit, after the last load that could use them."""
    import llama_cpp

    atexit.register(_close_devnull_files)
    return llama_cpp


def _close_devnull_files() -> None:
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        f = getattr(utils, name, None)
        if f is not None and not f.closed:
            f.close()


def quantize(src: Path, dst: Path, quant: str) -> None:
    """llama.cpp's quantizer, through llama-cpp-python."""
    import ctypes

    llama_cpp = _llama_cpp()

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[quant]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    with _stderr_to_file() as said:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        failed = rc != 0 or not dst.is_file()
        # Read inside the block: the log's folder goes with it.
        lines = [line for line in said().splitlines() if line.strip()] if failed else []
    if failed:
        raise ExportError(f"llama.cpp's quantizer failed to make {quant} (code {rc}): {lines[-1] if lines else ''}")


@contextlib.contextmanager
def _stderr_to_file():
    """The quantizer writes a line per tensor to the C stderr, and llama-cpp-python passes
    llama.cpp's log lines to Python's sys.stderr (which a window or pytest may have replaced): keep
    both (for the error message) instead of the terminal or the window's log. Yields a function
    that returns what was written so far.

    llama-cpp-python drops llama.cpp's lines below its logger's level, which any `Llama(verbose=False)`
    in the process (the GGUF self-check's) sets to ERROR: the level is lowered for the block, or a
    second export in the window's process would lose the quantizer's reason."""
    passed_on = logging.getLogger("llama-cpp-python")
    level = passed_on.level
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "quantize.log"
        sys.stderr.flush()
        saved = os.dup(2)
        python_side = io.StringIO()
        passed_on.setLevel(logging.DEBUG)
        try:
            with log.open("wb") as f, contextlib.redirect_stderr(python_side):
                os.dup2(f.fileno(), 2)
                try:
                    yield lambda: log.read_text(errors="replace") + python_side.getvalue()
                finally:
                    os.dup2(saved, 2)
        finally:
            passed_on.setLevel(level)
            os.close(saved)


def gguf_name(quant: str, filename: Optional[str]) -> str:
    return filename or f"model-{quant}.gguf"


def write(
    source,
    out: Path,
    progress=None,
    quant: str = DEFAULT_QUANT,
    filename: Optional[str] = None,
    built_on: Optional[Path] = None,
    extras: Optional[dict] = None,
    companions: tuple[str, ...] = (),
    **_options,
) -> None:
    """`built_on`: the merged export of the same flow, already written and checked in 16 bits
    (else a scratch merge is written here first). `companions`: for a file destination, the name
    of its Modelfile (_companions); a folder of its own gets `Modelfile`."""
    from engine.export import merged as merged_kind
    from engine.export import modelfile
    from engine.export.selfcheck import trained_tokenizer

    if quant not in QUANTS:
        raise ExportError(f"unknown GGUF type '{quant}' (choose {', '.join(QUANTS)})")
    name = gguf_name(quant, filename)
    scratch = None
    merged_dir = built_on
    if merged_dir is None:
        scratch = out / ".merged-16bit"
        scratch.mkdir()
        if progress:
            progress("writing the merged model in 16 bits for the converter")
        merged_kind.write(source, scratch, progress)
        merged_dir = scratch
    try:
        dtype = _stored_dtype(Path(merged_dir))
        if quant in ("f16", "bf16"):
            _run_converter(Path(merged_dir), out / name, quant, progress)
        else:
            wide = out / ".model-16bit.gguf"
            _run_converter(Path(merged_dir), wide, "bf16" if dtype == "bfloat16" else "f16", progress)
            if progress:
                progress(f"quantizing to {quant} with llama.cpp")
            quantize(wide, out / name, quant)
            wide.unlink()
        import json

        gen_path = Path(merged_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        tokenizer = trained_tokenizer(source)
        mf_name = companions[0] if companions else modelfile.MODELFILE
        info = modelfile.write_modelfile(
            out, name, tokenizer, gen, runtime_adds_bos=_adds_bos(out / name), name=mf_name, thinking=_thinking(source)
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if extras is not None:
        extras.update(info)
        extras["gguf"] = name


# Architectures whose llama.cpp converter reads the vocabulary from tokenizer.model and nothing else
# (conversion/gemma.py: GemmaModel and Gemma2Model call _set_vocab_sentencepiece unconditionally;
# Gemma-3's falls back to tokenizer.json), with the name a person knows them by.
SENTENCEPIECE_ONLY = {"GemmaForCausalLM": "Gemma", "Gemma2ForCausalLM": "Gemma-2"}


def refuses(source, **_options) -> Optional[str]:
    """Why the run cannot be exported as GGUF, before anything is written: a model llama.cpp converts
    from tokenizer.model only (SENTENCEPIECE_ONLY) whose tokenizer folders (the adapter's, the base
    model's: merged.tokenizer_folders, where the merged export copies it from) hold none; the
    converter would stop with "File not found: tokenizer.model" after the merge. None: it can."""
    import json

    from engine.export.merged import tokenizer_folders

    folders = tokenizer_folders(source)
    family = None
    for folder in folders[1:]:
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        family = next(
            (SENTENCEPIECE_ONLY[a] for a in config.get("architectures") or [] if a in SENTENCEPIECE_ONLY), None
        )
        break
    if family is None or any((folder / "tokenizer.model").is_file() for folder in folders):
        return None
    base = folders[-1] if len(folders) > 1 else source.adapter
    return (
        f"the GGUF export of this {family} model needs its tokenizer.model (llama.cpp's converter reads a "
        f"{family} vocabulary from that SentencePiece file only), and neither the run's adapter folder nor the "
        f"base model folder holds one: copy tokenizer.model from the model's Hugging Face repository into {base}"
    )


def _companions(dst: Path) -> tuple[str, ...]:
    """What a file destination X.gguf writes beside it: its Modelfile, named by modelfile_name."""
    from engine.export import modelfile

    return (modelfile.modelfile_name(dst.parent, dst.name),)


def _stored_dtype(folder: Path) -> str:
    import json

    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "bfloat16"
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")


def _adds_bos(path: Path) -> bool:
    """Whether llama.cpp (and Ollama, which tokenizes through it) adds a BOS token itself for this
    GGUF, asked of llama.cpp's own vocabulary: a GGUF without tokenizer.ggml.add_bos_token gets
    the tokenizer type's default (true for SentencePiece), so the metadata alone is not the answer."""
    llama_cpp = _llama_cpp()

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with _stderr_to_file():
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ExportError(f"llama.cpp cannot read the vocabulary of {path.name}")
    try:
        return bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(model)))
    finally:
        llama_cpp.llama_model_free(model)


def check(folder: Path) -> None:
    ggufs = [p for p in folder.glob("*.gguf") if not p.name.startswith(".")]
    if len(ggufs) != 1:
        raise ExportError(f"the GGUF export holds {len(ggufs)} .gguf files, not one")
    with ggufs[0].open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ExportError(f"{ggufs[0].name} is not a GGUF file")
    from engine.export import modelfile

    if modelfile.modelfile_of(folder, ggufs[0].name) is None:
        raise ExportError(f"the GGUF export has no Modelfile whose FROM is ./{ggufs[0].name}")


def estimate(source, quant: str = DEFAULT_QUANT, built_on: Optional[Path] = None, **_options) -> Optional[int]:
    """The peak: the 16-bit merged scratch copy (unless the merged export is reused), the 16-bit
    GGUF before quantizing, and the output."""
    from engine.export.merged import base_parameters

    params = base_parameters(source)
    if params is None:
        return None
    total = _BYTES_PER_PARAM.get(quant, 2.0) * params
    if quant not in ("f16", "bf16"):
        total += 2 * params
    if built_on is None:
        total += 2 * params
    return int(total) + 50_000_000


# -- the self-check ----------------------------------------------------------------------------
@contextlib.contextmanager
def plain_cpu_buffers(llama_cpp):
    """Load with llama.cpp's plain CPU weight buffers (`use_extra_bufts` off: no runtime weight
    repacking). llama.cpp 0.3.36's repacked q8_0 path crashes (SIGSEGV in decode) on tensors as
    narrow as the demo model's (128 columns) on AVX-512/AMX CPUs; the plain buffers hold the
    weights exactly as the file stores them, which is what the check is about. Llama() has no
    argument for it, so its default-params factory is wrapped for the duration of the load."""
    module = llama_cpp.llama.llama_cpp
    original = module.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = original


def load_for_check(llama_cpp, path, n_ctx: int, n_threads: int):
    """The self-check's llama.cpp model (here and in the child, engine/export/_gguf_probe.py): every
    position's logits kept, CPU only, plain weight buffers, quiet."""
    with plain_cpu_buffers(llama_cpp):
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            logits_all=True,
            n_gpu_layers=0,
            n_threads=n_threads,
            seed=0,
            verbose=False,
        )


def _crashes_in_child(path: Path, n_ctx: int, n_threads: int, probes) -> Optional[str]:
    """None when llama.cpp loads the GGUF and runs a scored evaluation and a few greedy tokens in a
    child process (engine/export/_gguf_probe.py); else the self-check's reason. A failed llama.cpp
    assert aborts its process: in the exporting process it would take the studio's window down."""
    first = probes[0] if probes else None
    cmd = [sys.executable, str(Path(__file__).with_name("_gguf_probe.py")), str(path), str(n_ctx), str(n_threads)]
    cmd += [json.dumps(list(first.ids) if first else []), json.dumps(list(first.prompt_ids) if first else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode == 0:
        return None
    lines = [line.strip() for line in (out.stderr + "\n" + out.stdout).splitlines() if line.strip()]
    asserted = [m.group(0) for line in lines for m in [re.search(r"GGML_ASSERT\(.*\) failed", line)] if m]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    if asserted:
        why = asserted[-1]
    elif raised:
        why = raised[-1]
    elif out.returncode < 0:
        why = f"stopped by signal {-out.returncode}"
    else:
        why = lines[-1] if lines else f"exit code {out.returncode}"
    if asserted or out.returncode < 0:
        return f"llama.cpp crashes running the GGUF ({why[:300]}); Ollama and LM Studio run the same llama.cpp code"
    return f"llama.cpp cannot run the GGUF ({why[:300]})"


def verify(folder: Path, source, ref, progress=None, quant: str = DEFAULT_QUANT, **_options):
    """Load the GGUF with llama.cpp and compare it with the trained model; lint its metadata."""
    import numpy as np
    import torch

    from engine.export import selfcheck
    from engine.export.selfcheck import MAX_GENERATE, STOP_WITHIN, TWO_TURNS, Lint

    llama_cpp = _llama_cpp()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    ref.build()
    ref.release()
    path = next(p for p in folder.glob("*.gguf") if not p.name.startswith("."))
    tok = ref.tokenizer
    n_ctx = max(512, max(len(p.ids) for p in ref.probes) + STOP_WITHIN + 8)
    n_threads = max(1, min(4, os.cpu_count() or 1))
    if progress:
        progress("self-check: loading the GGUF with llama.cpp")
    crash = _crashes_in_child(path, n_ctx, n_threads, ref.probes)
    if crash is not None:
        return selfcheck.failed("gguf", path, crash)
    try:
        llm = load_for_check(llama_cpp, path, n_ctx, n_threads)
    except Exception as exc:  # llama.cpp says only "failed to load model"
        return selfcheck.failed("gguf", path, f"llama.cpp cannot load the GGUF: {exc}")
    try:
        meta = dict(llm.metadata)
        lints: list[Lint] = []

        # EOS in the metadata: what llama.cpp, Ollama and LM Studio read to stop.
        hf_eos = tok.eos_token_id
        eos = meta.get("tokenizer.ggml.eos_token_id")
        if eos is None:
            lints.append(
                Lint(
                    "eos",
                    False,
                    "the GGUF's metadata has no tokenizer.ggml.eos_token_id: runtimes guess where a reply ends "
                    "and may never stop",
                )
            )
        elif hf_eos is not None and int(eos) != int(hf_eos):
            lints.append(
                Lint("eos", False, f"the GGUF's EOS is token {eos}, the tokenizer's is {hf_eos} ({tok.eos_token!r})")
            )
        else:
            lints.append(Lint("eos", True, f"the GGUF's EOS is {tok.eos_token!r} (id {eos}), as in the tokenizer"))
        end = selfcheck.turn_end_token(tok)
        if end is not None:
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            ok = bool(llama_cpp.llama_vocab_is_eog(vocab, end))
            name = tok.convert_ids_to_tokens(end)
            lints.append(
                Lint(
                    "turn end",
                    ok,
                    f"llama.cpp stops at {name!r}, the template's end of turn"
                    if ok
                    else f"llama.cpp does not stop at {name!r}, the token that ends a turn in the template",
                )
            )

        # The chat template in the metadata, rendered by llama-cpp-python's Jinja formatter.
        template = meta.get("tokenizer.chat_template")
        if not template:
            lints.append(
                Lint("template", False, "the GGUF's metadata holds no chat template: runtimes fall back to a guess")
            )
        else:
            try:
                rendered = Jinja2ChatFormatter(
                    template=template, eos_token=tok.eos_token or "", bos_token=tok.bos_token or ""
                )(messages=TWO_TURNS).prompt
            except Exception as exc:  # a template llama.cpp's renderer cannot run is a failure too
                rendered = f"<error: {exc}>"
            same = rendered == ref.two_turns()
            lints.append(
                Lint(
                    "template",
                    same,
                    "the GGUF's chat template renders a two-turn conversation as in training"
                    if same
                    else "the GGUF's chat template renders a two-turn conversation differently from training",
                )
            )

        lints.append(_lint_prompt_tokens(llm, tok, ref, folder, source))

        # llama.cpp's tokenizer against the trained one, on the rendered held-out conversations.
        bad = 0
        for p in ref.probes:
            want = tok(p.text, add_special_tokens=False)["input_ids"]
            if llm.tokenize(p.text.encode("utf-8"), add_bos=False, special=True) != want:
                bad += 1
        lints.append(
            Lint(
                "tokenizer",
                bad == 0,
                "llama.cpp tokenizes the held-out conversations exactly as the tokenizer does"
                if bad == 0
                else f"llama.cpp tokenizes {bad} of {len(ref.probes)} held-out conversations differently "
                "from the tokenizer",
            )
        )

        if progress:
            progress(f"self-check: scoring {len(ref.probes)} held-out examples with llama.cpp")
        art = []
        for p in ref.probes:
            llm.reset()
            llm.eval(p.ids)
            scores = np.asarray(llm.scores[: len(p.ids)], dtype=np.float32)[p.positions]
            art.append(torch.log_softmax(torch.from_numpy(scores.copy()), -1))
        metrics = selfcheck.compare(ref.logprobs, art, ref.probes)

        replies, out = [], []
        for p in ref.probes[:MAX_GENERATE]:
            llm.reset()
            res = llm.create_completion(prompt=p.prompt_ids, max_tokens=STOP_WITHIN, temperature=0.0, top_k=1)
            choice = res["choices"][0]
            stopped = choice.get("finish_reason") == "stop"
            text = choice["text"].strip()
            replies.append((text, stopped))
            out.append({"prompt": p.prompt, "reply": text, "stopped": stopped})
        lints += selfcheck.lint_stops(replies, ref, "llama.cpp")
        same = sum(r == ref.decode(i) for (r, _), (i, _) in zip(replies, ref.replies))
        metrics["same_replies"] = f"{same}/{len(replies)}"
        metrics["quant"] = quant
    finally:
        llm.close()
    return selfcheck.verdict("gguf", path, KIND.limits(quant=quant), metrics, lints, out, ref)


def _thinking(source):
    """The run's data.thinking (its config.yaml), which the Modelfile's template renders with; None
    without a run config (the template's default)."""
    from engine.export import ExportError

    try:
        return source.config().data.thinking
    except ExportError:
        return None


def _lint_prompt_tokens(llm, tok, ref, folder: Path, source=None):
    """What Ollama feeds the model: the Modelfile's TEMPLATE rendered for each held-out prompt,
    tokenized by llama.cpp with the BOS it adds itself, must be the tokens the trained model saw
    (no second BOS, nothing lost)."""
    from engine.export import modelfile
    from engine.export.selfcheck import Lint

    path = modelfile.modelfile_of(folder, Path(llm.model_path).name)
    if path is None:
        return Lint("modelfile", False, "there is no Modelfile beside the GGUF")
    adds_bos = _adds_bos(Path(llm.model_path))
    tr = modelfile.translate(tok, runtime_adds_bos=adds_bos, thinking=_thinking(source))
    written = modelfile.read_modelfile(path)["template"]
    if tr.template is None or written != tr.template:
        reason = tr.reason or "the Modelfile's TEMPLATE is not the translation of the tokenizer's template"
        return Lint("modelfile", False, f"the Modelfile has no checked TEMPLATE ({reason})", blocking=False)
    bad = []
    for p in ref.probes:
        if not p.messages:
            continue
        head = p.messages[: max(i for i, m in enumerate(p.messages) if m["role"] != "assistant") + 1]
        ids = llm.tokenize(tr.render(head).encode("utf-8"), add_bos=adds_bos, special=True)
        if ids != p.prompt_ids:
            bad.append((ids, p.prompt_ids))
    if not bad:
        return Lint("modelfile", True, "the Modelfile's template gives llama.cpp the trained prompt tokens (one BOS)")
    got, want = bad[0]
    bos = llm.token_bos()
    double = got[:2] == [bos, bos] and want[:1] == [bos] and want[1:2] != [bos]
    what = "a second BOS token" if double else "different tokens"
    return Lint("modelfile", False, f"the Modelfile's template gives llama.cpp {what} on {len(bad)} held-out prompts")


def published(dst: Path, source, extras: dict, quant: str = DEFAULT_QUANT, **_options) -> None:
    """The Modelfile's final path and the command that makes an Ollama model of it."""
    from engine import runs
    from engine.export import modelfile

    folder = dst.parent if dst.suffix.lower() == ".gguf" else dst
    run = runs.run_folder_of(source.adapter)
    name = modelfile.model_name(f"{run.name}-{quant}")
    path = modelfile.modelfile_of(folder, extras.get("gguf") or dst.name) or folder / modelfile.MODELFILE
    extras["modelfile"] = str(path)
    extras["ollama_command"] = modelfile.ollama_command(path, name)


def notes(extras: dict) -> list[str]:
    """What to say after a GGUF export besides its verdict: a Modelfile without a TEMPLATE."""
    if extras.get("template_translated"):
        return []
    return [
        f"Modelfile: no TEMPLATE, the chat template cannot be translated ({extras.get('template_reason')}); "
        "Ollama falls back to the GGUF's own template."
    ]


KIND = ExportKind(
    name="gguf",
    title="GGUF",
    label="GGUF for llama.cpp / Ollama (with a Modelfile)",
    help="GGUF file (OUT.gguf) or folder; the type is --quant",
    stage="Converting to GGUF with llama.cpp…",
    write=write,
    check=check,
    verify=verify,
    estimate=estimate,
    requires=("llama_cpp", "gguf", "sentencepiece", "torch", "transformers", "peft"),
    also_missing=converter_missing,
    refuses=refuses,
    file_suffix=".gguf",
    companions=_companions,
    published=published,
    options=(
        ExportOption(
            "quant", QUANTS, "GGUF type: q8_0 is close to the 16-bit model, q4_k_m smaller with a stated drop"
        ),
    ),
    thresholds=LIMITS,
    builds_on="merged",
    notes=notes,
    next_command=lambda extras: extras.get("ollama_command", ""),
    next_command_for="Ollama",
    install=lambda progress=None: install_extra(progress),
    install_label="Install GGUF support…",
    install_help="pip install tunesmith[gguf] (builds llama-cpp-python: several minutes)",
    install_stage="Installing GGUF support (llama-cpp-python builds from source: several minutes)…",
)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m engine.export fetch-converter [SDIST]`: put llama.cpp's converter in place."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "fetch-converter":
        print("usage: python -m engine.export fetch-converter [llama_cpp_python-X.tar.gz]", file=sys.stderr)
        return 2
    try:
        print(fetch_converter(args[1] if len(args) > 1 else None, progress=print))
    except (ExportError, OSError, StopIteration) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


# -- installing the extra (the Export page's button, scripts/install.sh) ------------------------
def extra_requirements() -> list[str]:
    """The pinned requirements of `tunesmith[gguf]`, read from the installed project's metadata
    (pyproject.toml is the one place they are written), else the pins above."""
    from importlib import metadata

    try:
        reqs = metadata.requires("tunesmith") or []
    except metadata.PackageNotFoundError:
        reqs = []
    pins = [r.split(";")[0].strip() for r in reqs if "extra ==" in r and "gguf" in r.split("extra ==")[1]]
    return pins or [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", f"gguf=={GGUF}", "sentencepiece==0.2.3"]


def missing() -> list[str]:
    """What the GGUF export lacks, as the registry names it (empty when it can run)."""
    return KIND.missing()


def install_extra(progress=None) -> Path:
    """pip-install the [gguf] extra's pins into this Python (llama-cpp-python builds from source:
    minutes), streaming pip's output to `progress`, then fetch llama.cpp's converter."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("llama_cpp", "gguf", "sentencepiece")):
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
        cmd += extra_requirements()
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
        if progress:
            progress("$ " + " ".join(cmd[2:]))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail = (tail + [line])[-5:]
                if progress:
                    progress(line)
        if proc.wait() != 0:
            raise ExportError(f"pip could not install {' '.join(extra_requirements())}: {tail[-1] if tail else ''}")
    return fetch_converter(progress=progress)
