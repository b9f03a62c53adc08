"""Guard mode, the user's side: ``check()`` reads the guard flags now (the mechanism: fp4dispatch/dispatch/guard.py).

Opt-in with ``FP4DISPATCH_GUARD=1`` or ``Dispatcher(guard=True)``; docs/integration.md, "Guard mode".
"""
from __future__ import annotations

from .api import get_dispatcher
from .dispatch.guard import DEFAULT_EVERY, Finding, Guard, nonfinite_from_finite

__all__ = ["check", "Guard", "Finding", "DEFAULT_EVERY", "nonfinite_from_finite"]


def check(dispatcher=None) -> list[Finding]:
    """Check the guard flags of ``dispatcher`` (default: the process-wide one) now; [] when guard mode is off."""
    if dispatcher is None:
        dispatcher = get_dispatcher()
    g = getattr(dispatcher, "guard", None)
    return g.check(dispatcher) if g is not None else []
