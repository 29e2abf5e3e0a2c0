"""The environment of a child Python process a test starts (`python -m engine`, torchrun, the
studio): the checkout first on PYTHONPATH, ahead of what the parent had. A GPU host keeps its
extra wheels on PYTHONPATH, and a child that lost them fails to import them."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
