"""Guard against a PySide6 reference-count bug on Python 3.11.

PySide6 6.12 wheels treat None and True as immortal objects (as they are from Python 3.12
on, PEP 683): every Qt call returning void hands back None, and every Signal.emit hands back
True, without taking a reference. On Python 3.11 each such call steals one reference, and
after a few thousand calls the interpreter aborts with "none_dealloc: deallocating None" (or
"bool_dealloc"), at a random moment or at exit.

Where the leak is detected, the three singletons get a reference count so large that no
session can drain it, which is exactly what 3.12 does for them. Nothing changes on Python
3.12+ or with a PySide6 that counts correctly. The real fix is a PySide6 build that supports
3.11 properly, or Python >= 3.12 for the studio.
"""

from __future__ import annotations

import ctypes
import sys

IMMORTAL = 1 << 60
applied = False


def _leaks() -> bool:
    from PySide6.QtCore import QObject

    obj = QObject()
    before = sys.getrefcount(None)
    for _ in range(32):
        obj.setObjectName("probe")  # a void method: returns None
    return sys.getrefcount(None) < before - 16


def apply() -> bool:
    """Make None, True and False immortal when this PySide6 leaks them; True when applied."""
    global applied
    if applied or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return applied
    try:
        if not _leaks():
            return False
    except Exception:  # PySide6 missing: nothing to guard
        return False
    for singleton in (None, True, False):
        # ob_refcnt is the first field of every CPython 3.11 object.
        ctypes.c_ssize_t.from_address(id(singleton)).value = IMMORTAL
    applied = True
    return True
