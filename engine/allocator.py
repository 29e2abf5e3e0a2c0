"""The CUDA caching allocator's setting for a process the engine trains in, made by its entry points.

Packed micro-batches change size every step and offload reloads into recycled buffers: with
the default caching allocator, reserved memory drifts a GiB or more above what is allocated,
which on a laptop card is memory the run cannot use. Expandable segments grow one mapping
instead of caching odd-sized blocks.

torch reads the setting once, when it first initialises CUDA, so it must be in the environment
before that. Importing the engine does not set it: a library import must not change the
environment of a process it does not own. The entry points whose process is ours call
`prefer_expandable_segments()` first thing: the CLI (`engine.cli.main`, also each torchrun rank
the studio starts), the studio's start (`studio.app.main`, whose worker thread trains in that
process) and the bench (`bench/__init__.py`, for every `python -m bench...`).
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional

SETTING = "expandable_segments:True"


def prefer_expandable_segments(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Ask for expandable segments in `environ` (default: this process's) unless a setting is
    already there (a person's own wins, under either of torch's names); Linux only: elsewhere
    torch warns that it is unsupported. Returns whether it set it."""
    env = os.environ if environ is None else environ
    if sys.platform != "linux" or env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF"):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = SETTING
    return True
