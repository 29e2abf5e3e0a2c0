"""Copy the GPU host's missing wheels from .whl/ to .gpuw/, with bitsandbytes cut to the CUDA 13
and CPU libraries the host uses (43 MB -> 7 MB), so the checkout, .gpuw/ and the Unsloth bundle
travel together under the device tool's 64 MiB (docs/GPU.md).

    python scripts/slim_gpu_wheels.py [--src .whl] [--dst .gpuw] [--keep cuda130,cuda132,_cpu.so]
"""

from __future__ import annotations

import argparse
import shutil
import zipfile
from pathlib import Path


def slim_wheel(src: Path, dst: Path, keep: tuple[str, ...]) -> None:
    """Write `src` to `dst` without the shared libraries whose names match none of `keep`,
    and without their RECORD lines (pip installs the rest as it is)."""

    def wanted(name: str) -> bool:
        return not name.endswith(".so") or any(k in name for k in keep)

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if not wanted(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if wanted(line.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default=".whl")
    p.add_argument("--dst", default=".gpuw")
    p.add_argument("--keep", default="cuda130,cuda132,_cpu.so", help="library name parts kept in bitsandbytes")
    args = p.parse_args()
    src, dst = Path(args.src), Path(args.dst)
    dst.mkdir(exist_ok=True)
    keep = tuple(k for k in args.keep.split(",") if k)
    for wheel in sorted(src.glob("*.whl")):
        if wheel.name.startswith("bitsandbytes-"):
            slim_wheel(wheel, dst / wheel.name, keep)
        else:
            shutil.copy(wheel, dst / wheel.name)
        print(f"{dst / wheel.name}: {(dst / wheel.name).stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
