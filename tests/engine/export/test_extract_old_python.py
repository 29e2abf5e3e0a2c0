"""The converter's and the conformance fixtures' extraction on a Python without tarfile's "data"
filter (Debian 12's stock 3.11.2: extractall(filter=...) is a TypeError there, which turned GGUF
export off on a fresh install)."""

from __future__ import annotations

import io
import tarfile

import pytest

from engine.export import ExportError
from engine.export.gguf import extract_members


def _tarball(path, names):
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = f"content of {name}".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# Whether the Python running the tests has the filter (3.11.4 on; CI's Debian 12 Python has not).
HAS_FILTER = hasattr(tarfile, "data_filter")


@pytest.fixture
def old_python(monkeypatch):
    """tarfile as Python 3.11.2 has it: no data_filter, and extractall takes no filter."""
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    real = tarfile.TarFile.extractall

    def extractall(self, path=".", members=None, *, numeric_owner=False, **kw):
        if kw:
            raise TypeError(f"TarFile.extractall() got an unexpected keyword argument {next(iter(kw))!r}")
        extra = {"filter": "data"} if HAS_FILTER else {}  # the real call, as this Python takes it
        return real(self, path, members, numeric_owner=numeric_owner, **extra)

    monkeypatch.setattr(tarfile.TarFile, "extractall", extractall)


@pytest.mark.parametrize("python", ["new", "old"])
def test_plain_members_are_extracted(tmp_path, request, python):
    if python == "old":
        request.getfixturevalue("old_python")
    sdist = _tarball(tmp_path / "s.tar.gz", ["pkg/convert_hf_to_gguf.py", "pkg/gguf-py/gguf/__init__.py"])
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        extract_members(tar, tmp_path / "out", members)
    assert (tmp_path / "out/pkg/convert_hf_to_gguf.py").read_text() == "content of pkg/convert_hf_to_gguf.py"
    assert (tmp_path / "out/pkg/gguf-py/gguf/__init__.py").exists()


def test_a_member_outside_the_folder_is_refused_without_the_filter(tmp_path, old_python):
    sdist = _tarball(tmp_path / "s.tar.gz", ["ok.py", "../escape.py"])
    with tarfile.open(sdist) as tar, pytest.raises(ExportError, match="escape.py"):
        extract_members(tar, tmp_path / "out", tar.getmembers())
    assert not (tmp_path / "escape.py").exists()
