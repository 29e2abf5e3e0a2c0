"""The engine's heavy imports (torch, transformers, peft, datasets), done once, by whichever thread
needs them first, while every other thread that might import them waits.

Those libraries are not safe to import from two threads at once: datasets probing a half-imported
transformers fails with "module 'transformers' has no attribute ...", and a run started a second
after the window appears failed with "cannot import name 'AutoTokenizer'". So until the warm-up is
done, background tasks (studio.tasks) run one at a time under `gate`, and the training thread
calls `ensure_warm()` before it touches the engine: it waits for, or does, the same warm-up.
Afterwards nothing waits and the lanes run in parallel.
"""

from __future__ import annotations

import threading

# Re-entrant: the warm-up task itself runs under the gate and calls ensure_warm().
gate = threading.RLock()
done = threading.Event()
_seconds = 0.0


def ensure_warm() -> float:
    """Import what a run needs, once; returns the seconds the imports took (0 after the first)."""
    global _seconds
    if done.is_set():
        return 0.0
    with gate:
        if not done.is_set():
            from engine.api import warm_up

            try:
                _seconds = warm_up()
            finally:
                # A failed import shows up, readable, where it is used; nothing waits for ever.
                done.set()
            return _seconds
    return 0.0
