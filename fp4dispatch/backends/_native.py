"""Plumbing shared by the native (library-backed) backends: one overridable device question, imports that never
crash, and the alignment rule every CUTLASS-family FP4 kernel shares.

Native backends are ``risky``: a kernel fault can leave a sticky CUDA error, so the dispatcher probes them after the
safe backends, and in a worker process when isolation is on. They must therefore pickle: anything cached from a
library (the module, prepared weights) is dropped by ``__getstate__`` and rebuilt in the worker.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..errors import describe_exception
from ..problem import Problem
from .base import BaseBackend

__all__ = ["NativeBackend", "import_library", "alignment_reason"]


def import_library(name: str, install_hint: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, reason)`` when ``name`` cannot be imported for any reason.

    A library built against another torch fails with an ``OSError: ... undefined symbol`` or a ``RuntimeError``
    rather than an ``ImportError``; every such failure is a reason, never a crash of the caller.
    """
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as e:
        if e.name == name:
            return None, f"{name} is not installed ({install_hint})"
        return None, f"{name} import failed: {describe_exception(e)}"
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any import failure is an availability verdict
        return None, f"{name} import failed: {describe_exception(e)}"


def alignment_reason(problem: Problem, n_mult: int, k_mult: int, who: str) -> str | None:
    """Why ``problem`` breaks ``who``'s N/K alignment, or None. fp4dispatch does not pad for native kernels."""
    bad = [f"{d}={v} is not a multiple of {m}" for d, v, m in (("N", problem.n, n_mult), ("K", problem.k, k_mult))
           if v % m]
    if not bad:
        return None
    return f"{who} needs N % {n_mult} == 0 and K % {k_mult} == 0; " + " and ".join(bad) + \
        " (not padded: the triton/reference backends take any N, K multiple of 16)"


class NativeBackend(BaseBackend):
    """Base of the library-backed backends: ``risky``, lazy imports, one place that asks the device."""

    risky = True
    # attributes rebuilt after unpickling (modules and device tensors do not cross into a probe worker)
    _transient: tuple[str, ...] = ("_lib",)

    def __init__(self) -> None:
        self._lib: ModuleType | None = None

    def device_capability(self, device: torch.device) -> int | None:
        """Compute capability as an int (90, 100, 120) of a CUDA device, None elsewhere.

        The only place a native backend asks the device; tests override it to run the adapters on CPU tensors.
        """
        if device.type != "cuda":
            return None
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        for k in self._transient:
            if k in d:
                d[k] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._reset_transient()

    def _reset_transient(self) -> None:
        """Rebuild what ``__getstate__`` dropped (subclasses with caches extend this)."""
