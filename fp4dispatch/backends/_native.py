"""Plumbing shared by the native (library-backed) backends: one overridable device question, imports that never
crash, and the alignment rule every CUTLASS-family FP4 kernel shares.

Native backends are ``risky``: a kernel fault can leave a sticky CUDA error, so the dispatcher probes them after the
safe backends, and in a worker process when isolation is on. They must therefore pickle: anything cached from a
library (the module, prepared weights) is dropped by ``__getstate__`` and rebuilt in the worker.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import weakref
from collections import OrderedDict, deque
from types import ModuleType
from typing import Callable

import torch

from ..errors import describe_exception
from ..problem import Problem
from .base import BaseBackend

__all__ = ["NativeBackend", "import_library", "alignment_reason", "PreparedWeightCache", "clear_prepared_weights"]

log = logging.getLogger("fp4dispatch")


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


def library_installed(name: str) -> bool:
    """Whether ``name`` can be found for import, without importing it (a module set to None in ``sys.modules``
    cannot be)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails, a module without a spec
        return False


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
    fp4_tensor_cores = True  # the native NVFP4 GEMMs run on block-scaled FP4 MMA (humming:w4a16 says otherwise)
    # attributes rebuilt after unpickling (modules and device tensors do not cross into a probe worker)
    _transient: tuple[str, ...] = ("_lib",)
    library = ""  # the module ``run`` needs, imported by ``_load`` with ``install_hint`` in its reason
    install_hint = ""

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

    def _import(self) -> tuple[ModuleType | None, str | None]:
        """``(module, None)`` or ``(None, why)`` for ``library`` (a backend that needs more overrides this)."""
        return import_library(self.library, self.install_hint)

    def _load(self) -> ModuleType:
        """The library, imported once for ``run``; raises with the reason when it cannot be."""
        lib, why = self._import()
        if lib is None:
            raise RuntimeError(f"{self.name}: {why}")
        self._lib = lib
        return lib


# -- prepared weights ------------------------------------------------------------------------------------------------
# Some native kernels read the weight in a layout of their own (trtllm's shuffled rows, Humming's repacked words). That
# copy is made once per weight, in a small LRU cache bounded in entries and bytes. The key is the weight's and its
# scale's storage, offset, shape, stride and autograd version counter, and each entry holds weak references to both
# storages, so an in-place change (``w.copy_(...)``) or a freed weight whose memory is reused is never served stale.
# Not seen: a write that bypasses the version counter (through ``.data``, DLPack or a raw pointer) and in-place
# changes of inference-mode tensors (they have no version counter); call :func:`clear_prepared_weights` after such a
# write. When the working set exceeds the cache, weights are prepared on every call; that is logged once as a warning.
DEFAULT_MAX_ENTRIES = 64
DEFAULT_MAX_BYTES = 1 << 30

_ALL_CACHES: "weakref.WeakSet[PreparedWeightCache]" = weakref.WeakSet()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, _version(t))


def aligned_alpha(alpha: torch.Tensor, align: int = 16) -> torch.Tensor:
    """alpha as fp32 ``(1,)`` whose data pointer is ``align``-byte aligned (what native launchers check): itself, or
    a copy made on the device (no host sync)."""
    alpha = alpha.reshape(1)
    if alpha.data_ptr() % align == 0:
        return alpha
    return torch.empty(max(1, align // 4), dtype=torch.float32, device=alpha.device)[:1].copy_(alpha)


class PreparedWeightCache:
    """LRU of prepared weights, bounded in entries and bytes, keyed so that a changed or freed weight misses."""

    def __init__(self, who: str, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.who = who  # the backend whose prepared weights these are (named in the warning)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (refs, prepared, nbytes)
        self._bytes = 0
        self._evicted: deque[tuple] = deque(maxlen=1024)
        self._lock = threading.Lock()
        self._warned = False
        self.hits = self.misses = 0
        _ALL_CACHES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def get(self, b: torch.Tensor, b_scale: torch.Tensor, prepare: Callable[[], tuple],
            variant: object = None) -> tuple:
        """The prepared form of (b, b_scale), made by ``prepare()`` on a miss: a tuple whose tensors count
        against the byte limit (other items, such as a library's config object, are kept alongside). ``variant``
        tells apart forms of one weight prepared for different calls (e.g. per out dtype)."""
        key = (b.device, _tensor_key(b), _tensor_key(b_scale), variant)
        sb, ss = b.untyped_storage(), b_scale.untyped_storage()
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e[0][0]() is sb and e[0][1]() is ss:
                self._entries.move_to_end(key)
                self.hits += 1
                return e[1]
        prepared = prepare()
        nbytes = sum(t.numel() * t.element_size() for t in prepared if isinstance(t, torch.Tensor))
        drop = self._make_dropper(key)
        refs = (weakref.ref(sb, drop), weakref.ref(ss, drop))
        with self._lock:
            self.misses += 1
            if key[:2] in self._evicted and not self._warned:
                self._warned = True
                log.warning("fp4dispatch: %s prepares weights again on every call: its prepared-weight cache (%d "
                            "entries, %d MiB) is smaller than the working set; raise its PreparedWeightCache limits "
                            "or disable it with FP4DISPATCH_DISABLE=%s", self.who, self.max_entries,
                            self.max_bytes >> 20, self.who)
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            if nbytes <= self.max_bytes:
                self._entries[key] = (refs, prepared, nbytes)
                self._bytes += nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                k, (_, _, nb) = self._entries.popitem(last=False)
                self._bytes -= nb
                self._evicted.append(k[:2])
        return prepared

    def _make_dropper(self, key: tuple) -> Callable:
        self_ref = weakref.ref(self)

        def drop(_ref) -> None:  # the weight (or its scale) was freed: its prepared copy goes too
            cache = self_ref()
            if cache is None:
                return
            with cache._lock:
                e = cache._entries.pop(key, None)
                if e is not None:
                    cache._bytes -= e[2]

        return drop


def clear_prepared_weights() -> None:
    """Drop every prepared weight of every native backend (after a weight write the version counter cannot see)."""
    for cache in list(_ALL_CACHES):
        cache.clear()
