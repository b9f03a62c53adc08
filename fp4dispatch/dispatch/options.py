"""Checks of the :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher` constructor's arguments, made once when a
dispatcher is created: a wrong one is refused there, not found later inside a probe or a tuning run (where it would
read as the backends' fault and be written to the disk cache)."""
from __future__ import annotations

import os

from ..errors import InvalidInputError
from ..settings import Settings

__all__ = ["check_backends", "check_timer", "check_options"]


def check_backends(backends) -> list:
    """``backends`` as a list, each an object with a ``name`` (a non-empty str) and a ``run`` method, no two of the
    same name: the dispatcher probes, bans and caches a backend by its name, so a second one of a name would be judged
    by the first one's verdicts."""
    if isinstance(backends, (str, bytes)) or not hasattr(backends, "__iter__"):
        raise InvalidInputError(f"Dispatcher: backends must be a list of backend objects in priority order, or None "
                                f"for every built-in one; got {backends!r}. Pass e.g. [ReferenceBackend()], or "
                                "fp4dispatch.backends.default_backends() for the built-in ones")
    out = list(backends)
    seen: dict[str, int] = {}
    for i, b in enumerate(out):
        name = getattr(b, "name", None)
        if not isinstance(name, str) or not name or not callable(getattr(b, "run", None)):
            hint = (" To leave built-in backends out by name, set FP4DISPATCH_DISABLE" if isinstance(b, str) else "")
            raise InvalidInputError(f"Dispatcher: backends[{i}] must be a backend (an object with a non-empty str name "
                                    f"and a run method, e.g. a fp4dispatch.backends.base.BaseBackend subclass); got "
                                    f"{b!r}. Pass backend objects, e.g. fp4dispatch.backends.default_backends()."
                                    + hint)
        if name in seen:
            raise InvalidInputError(f"Dispatcher: backends must have distinct names (a backend is probed, banned and "
                                    f"cached by its name); got {name!r} at positions {seen[name]} and {i}. Give each "
                                    "backend a name of its own, or pass it once")
        seen[name] = i
    return out


def check_timer(name: str, fn):
    """``do_bench`` / ``screen_bench``: None or a callable. Anything else would fail every backend's timing run, and
    each backend would be banned from the key on disk as if it had failed."""
    if fn is not None and not callable(fn):
        raise InvalidInputError(f"Dispatcher: {name} must be None (the default timer) or a callable that takes a "
                                f"function and returns its time in milliseconds; got {fn!r}. Pass e.g. "
                                "triton.testing.do_bench (tests: a fake timer)")
    return fn


def check_options(cache_dir, settings, guard) -> None:
    """``cache_dir``: None, a str or a path; ``settings``: None or a Settings; ``guard``: None or a bool (a string
    such as "0" would read as true)."""
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise InvalidInputError(f"Dispatcher: cache_dir must be None (FP4DISPATCH_CACHE_DIR, else the user cache dir), "
                                f"a str or a path; got {cache_dir!r}. Pass e.g. cache_dir='/tmp/fp4cache'")
    if settings is not None and not isinstance(settings, Settings):
        raise InvalidInputError(f"Dispatcher: settings must be None (read from the FP4DISPATCH_* variables) or a "
                                f"fp4dispatch.settings.Settings; got {type(settings).__name__} {settings!r}. Pass e.g. "
                                "dataclasses.replace(fp4dispatch.settings.read_settings(), tune=False)")
    if guard is not None and not isinstance(guard, bool):
        raise InvalidInputError(f"Dispatcher: guard must be None (FP4DISPATCH_GUARD), True or False; got {guard!r}. "
                                "Pass guard=True to turn guard mode on")
