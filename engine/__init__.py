"""Tunesmith's training engine: Qt-free, driven by the CLI and by the studio window alike.

Public entry points: `engine.config.RunConfig`, `engine.train.session.TrainingSession` and the
event types in `engine.events`. Heavy libraries (torch, transformers) load lazily, so importing
this package is cheap.
"""

import os
import sys

__version__ = "0.1.0"

# Packed micro-batches change size every step and offload reloads into recycled buffers: with
# the default caching allocator, reserved memory drifts a GiB or more above what is allocated,
# which on a laptop card is memory the run cannot use. Expandable segments grow one mapping
# instead of caching odd-sized blocks. Set before torch initialises CUDA (the allocator reads it
# once); a user's own setting wins. Linux only: elsewhere torch warns that it is unsupported.
if sys.platform == "linux" and not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
