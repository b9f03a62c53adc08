"""Exception tree of fp4dispatch.

Every user-input problem is an :class:`InvalidInputError` (also a ``ValueError``), raised before any backend runs.
All classes pickle (they cross process boundaries when probes run in worker processes).
"""
from __future__ import annotations

import torch

__all__ = ["FP4DispatchError", "InvalidInputError", "BackendError", "NoUsableBackendError", "DeviceMemoryError",
           "MEMORY_ADVICE", "out_of_memory", "describe_exception", "describe_failure"]


class FP4DispatchError(Exception):
    """Base class of every error raised by fp4dispatch."""


class InvalidInputError(FP4DispatchError, ValueError):
    """An argument of ``fp4_mm`` (or of a format helper) breaks the NVFP4 contract."""


class BackendError(FP4DispatchError):
    """A backend was asked for by name but cannot serve the call (unknown, unhealthy, or unsupported)."""


class NoUsableBackendError(FP4DispatchError):
    """No backend can compute this problem; the message lists every backend's reason."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.reasons))


class DeviceMemoryError(FP4DispatchError, torch.OutOfMemoryError):
    """The device ran out of memory while fp4dispatch checked or tuned backends for a call (or while every backend
    ran it); ``reasons`` per backend. A state of the process, not a verdict on any backend: nothing is recorded
    against them. Also a ``torch.OutOfMemoryError``, so code that catches that (to retry with a smaller batch)
    catches this too."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.reasons))


# how every DeviceMemoryError ends
MEMORY_ADVICE = ("Nothing was recorded against the backends: the call can be made again once memory is free. Decide "
                 "and prove your shapes before the GPU fills up (fp4dispatch.warmup, python -m fp4dispatch.tune), or "
                 "leave more memory free")


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory: torch's allocator (``torch.OutOfMemoryError``) or a
    library's CUDA call (``CUDA error: out of memory``). Such a failure says nothing about the backend that met it."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def describe_exception(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters): how a failure is recorded as data."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:300]}" if msg else type(e).__name__


def describe_failure(e: BaseException, limit: int = 2000) -> str:
    """The whole text of ``e`` and of the exceptions that caused it (a compiler's error often says only where, and
    its cause says what), cut in the middle to at most ``limit`` characters: how a worker reports a failure."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}".rstrip())
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    text = "\ncaused by ".join(parts)
    if len(text) <= limit:
        return text
    head = limit // 4
    return text[:head] + " [...] " + text[len(text) - (limit - head - 7):]
