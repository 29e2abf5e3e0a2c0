"""Publishing a folder written under its ".tmp" name: one rename, so a reader sees the old one,
nothing, or the new one, never a half-written one; its files get the permissions a plain new
file gets (safetensors writes 0600 files, which other users and tools then cannot read)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_permissions(tmp: Path) -> None:
    """Give every file under `tmp` the permissions a plain new file gets (0644 under a 022 umask)."""
    umask = _umask()
    files = [tmp] if tmp.is_file() else (p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        if p.is_symlink():
            continue
        full = 0o777 if p.stat().st_mode & 0o111 else 0o666
        try:
            os.chmod(p, full & ~umask)
        except OSError:
            pass  # not ours to change (e.g. another owner); the file is still usable


def publish(tmp: Path, final: Path) -> Path:
    """Put a fully written `tmp` folder in place of `final` (the old one removed first). Its files
    get the umask's permissions first."""
    _normal_permissions(Path(tmp))
    shutil.rmtree(final, ignore_errors=True)
    Path(tmp).rename(final)
    return Path(final)
