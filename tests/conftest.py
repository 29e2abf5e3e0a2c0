"""Test set-up shared by every test.

Without a CUDA GPU, Triton kernels run through Triton's interpreter: the variable must be set
before triton decorates any kernel, so it is set here, before the engine is imported.
Qt runs offscreen so GUI tests need no display.
"""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine.allocator import prefer_expandable_segments  # noqa: E402

prefer_expandable_segments()  # tests train in this process as the CLI and the studio do

try:
    import torch

    _has_cuda = torch.cuda.is_available()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The suite runs on one worker per core (scripts/run-tests.sh: pytest-xdist): a worker's
        # torch threads would only contend with the other worker's.
        torch.set_num_threads(1)
except Exception:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
