"""llama.cpp's own files, taken from the pinned llama-cpp-python source distribution at test-data
build time and cached: the chat templates (`models/templates/*.jinja`, each the `chat_template` of
the HF repo it is named for), the vocabularies (`models/ggml-vocab-*.gguf`, with the `.inp`/`.out`
reference tokenizations llama.cpp's own tokenizer tests check), and `tests/test-chat-template.cpp`
(more official templates, inline, with their expected renders).

The sdist comes from the package registry through `engine.export.gguf.download_sdist` (the same
pip call `python -m engine.export fetch-converter` makes; pip's cache serves it the second time).
Nothing here runs at test run time once the cache holds the files: `upstream_dir()` returns the
cached folder, keyed on the llama-cpp-python version.

Cache: $TUNESMITH_CONFORMANCE_CACHE, else ~/.cache/tunesmith/conformance.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from engine.export.gguf import LLAMA_CPP_PYTHON, download_sdist, extract_members

# Paths under vendor/llama.cpp/ that the suite uses.
_WANTED_DIRS = {"models/templates/": (".jinja",), "models/": (".gguf", ".gguf.inp", ".gguf.out")}
_WANTED_FILES = ("tests/test-chat-template.cpp", "LICENSE")


def cache_root() -> Path:
    env = os.environ.get("TUNESMITH_CONFORMANCE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tunesmith" / "conformance"


def _wanted(rest: str) -> bool:
    if rest in _WANTED_FILES:
        return True
    for folder, suffixes in _WANTED_DIRS.items():
        name = rest[len(folder) :] if rest.startswith(folder) else None
        if name and "/" not in name and name.endswith(suffixes):
            return name.startswith("ggml-vocab-") or folder.endswith("templates/")
    return False


def _complete(dest: Path) -> bool:
    # Written whole and renamed in (extract), so the one file the suite needs most marks it done.
    return (dest / "tests" / "test-chat-template.cpp").is_file()


def extract(sdist: Path, dest: Path) -> Path:
    """The wanted files of `sdist`'s vendor/llama.cpp/ in `dest` (written whole, then renamed in)."""
    # A staging folder of its own, so two test workers extracting at once do not mix.
    staging = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 3)  # llama_cpp_python-X/vendor/llama.cpp/<rest>
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and m.isfile() and _wanted(parts[3]):
                m.name = parts[3]
                members.append(m)
        if not any(m.name == "tests/test-chat-template.cpp" for m in members):
            raise RuntimeError(f"{sdist} holds no vendor/llama.cpp/tests/test-chat-template.cpp")
        extract_members(tar, staging, members)  # the "data" filter where this Python has it
    if dest.exists() and not _complete(dest):
        shutil.rmtree(dest, ignore_errors=True)  # a leftover that was never whole
    try:
        staging.rename(dest)
    except OSError:  # another worker put the same files in first; theirs stays, as its tests may be reading it
        shutil.rmtree(staging, ignore_errors=True)
        if not _complete(dest):
            raise
    return dest


def upstream_dir() -> Path:
    """The cached llama.cpp files of llama-cpp-python LLAMA_CPP_PYTHON, fetched once."""
    dest = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if _complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        extract(download_sdist(tmp), dest)
    return dest


def template(name: str) -> str:
    """The text of models/templates/<name>.jinja."""
    return (upstream_dir() / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def vocab_file(name: str) -> Path:
    """models/ggml-vocab-<name>.gguf."""
    return upstream_dir() / "models" / f"ggml-vocab-{name}.gguf"


def reference_tokenizations(name: str) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's token ids) pairs from ggml-vocab-<name>.gguf.inp/.out."""
    base = vocab_file(name)
    inp = base.with_name(base.name + ".inp").read_text(encoding="utf-8")
    out = base.with_name(base.name + ".out").read_text(encoding="utf-8")
    # A marker line separates the texts (most files end with one too); the .out file holds one
    # line of ids per text.
    texts = inp.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    ids = [[int(t) for t in line.split()] for line in out.splitlines()]
    if len(texts) != len(ids):
        raise RuntimeError(f"{base.name}: {len(texts)} reference texts but {len(ids)} tokenizations")
    return list(zip(texts, ids))
