"""Installing a fast forward on one module instance, without touching anything else on it.

`install(module, fn, plan, kind)` sets the instance's ``forward`` to a `PatchedForward` that calls
``fn(module, plan, *args, **kwargs)``; an instance attribute shadows the class's forward, and
`nn.Module.__call__` picks it up, so hooks, gradient checkpointing and the class stay as they are.
The plan lives on our own object, never as an attribute of the transformers module, so:

- `installed(module)` finds a patch and its plan, `uninstall(module)` restores the stock forward;
- ``copy.deepcopy`` of a patched model copies each PatchedForward with its module and plan
  through the same memo, so the copy's forwards run on the copy's own layers and adapters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn


class PatchedForward:
    """The forward of one patched module: ``fn(module, plan, *args, **kwargs)``."""

    __slots__ = ("module", "fn", "plan", "kind")

    def __init__(self, module: nn.Module, fn: Callable, plan: Any, kind: str):
        self.module, self.fn, self.plan, self.kind = module, fn, plan, kind

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, self.plan, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<tunesmith {self.kind} forward of {type(self.module).__name__}>"


def install(module: nn.Module, fn: Callable, plan: Any, kind: str) -> None:
    # nn.Module.__setattr__ stores a plain callable in the instance __dict__.
    module.forward = PatchedForward(module, fn, plan, kind)


def installed(module: nn.Module, kind: Optional[str] = None) -> Optional[PatchedForward]:
    """The patch on `module` (of `kind`, when given), or None."""
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, PatchedForward) and fwd.module is module and (kind is None or fwd.kind == kind):
        return fwd
    return None


def uninstall(module: nn.Module, kind: Optional[str] = None) -> bool:
    """Restore the class's forward; True when `module` had a patch (of `kind`)."""
    if installed(module, kind) is None:
        return False
    del module.__dict__["forward"]
    return True
