"""Launch a ``@triton.jit`` kernel with less host time per call than ``kernel[grid](...)``.

On every call, ``kernel[grid](...)`` binds the arguments, specializes each one (alignment of each pointer,
divisibility of each int), builds a cache key from that and only then finds the compiled kernel. On the lent H200's
host that was half to two thirds of an eager ``fused_mm`` call (benchmarks/RESULTS.md, fourth session, run 5).
``launch`` keeps the compiled kernel that the first call returns under a key that holds everything those steps
read, so it never needs Triton's specialization rules: the value of every positional argument (of a tensor: its
dtype and its address mod 16, Triton's alignment specialization; of a TMA descriptor: the same of its base, its
block shape and layout), the keyword arguments (constexprs and launch options: scalars), the grid and the device.
A later call with an equal key launches that compiled kernel directly, with the argument list ``kernel[grid]`` would
pass it (every parameter in signature order, defaults filled in). If a direct launch raises, the fast path is
switched off for the process and the call goes through ``kernel[grid]``.
There is one entry per distinct key (e.g. per M a model runs with); the entries share the compiled kernels.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import jit_interpreted

__all__ = ["launch", "tma_desc"]

log = logging.getLogger("fp4dispatch")

_COMPILED: dict[tuple, tuple[object, list]] = {}
_PARAMS: dict[int, tuple[list[str], dict]] = {}
_fast = True
_interpreted = jit_interpreted  # a module attribute, so that tests can patch it


def _params(fn) -> tuple[list[str], dict]:
    """Parameter names in signature order, and the defaults."""
    got = _PARAMS.get(id(fn))
    if got is None:
        sig = fn.signature.parameters  # JITFunction keeps the inspect.Signature of the Python function
        got = (list(sig), {n: p.default for n, p in sig.items() if p.default is not p.empty})
        _PARAMS[id(fn)] = got
    return got


class _Address:
    """What a host TMA descriptor reads of its tensor (Triton's launcher and ``_desc_key``: ``data_ptr()``,
    ``dtype``), so that a cached descriptor holds no reference to a tensor and cannot keep a freed weight alive."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


@functools.lru_cache(maxsize=4096)
def tma_desc(ptr: int, dtype: torch.dtype, shape: tuple, strides: tuple, block: tuple, layout):
    """A Gluon host TMA descriptor over ``shape``/``strides`` (elements of ``dtype``) at address ``ptr``, with the
    shared-memory ``layout`` of its boxes. Cached by what it describes: the same address and view make the same
    tensor map, whatever tensor lies there now. A view plus ``TensorDescriptor.from_tensor`` cost ~12 us of host time
    each; the Gluon kernels pass two (wgws), three (wgds) or four (gvws) per call."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(_Address(ptr, dtype), list(shape), list(strides), list(block), layout)


def _desc_key(a):
    """A host TMA descriptor (Triton's or Gluon's ``TensorDescriptor``) by what types the compiled kernel: dtype, base
    alignment, block shape and layout (its launcher builds the tensor map from the rest on every call); any other
    argument as itself."""
    base = getattr(a, "base", None)
    if hasattr(base, "data_ptr") and hasattr(base, "dtype") and hasattr(a, "block_shape"):  # a tensor or _Address
        return ("desc", base.dtype, base.data_ptr() % 16, tuple(a.block_shape), getattr(a, "layout", None))
    return a


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``; from the second call with the same key on, without Triton's argument binding.
    ``args`` are the leading parameters; ``kwargs`` the keyword parameters (constexprs) and launch options
    (``num_warps``, ``launch_pdl``, ...)."""
    global _fast
    grid = (*grid, *(1,) * (3 - len(grid)))  # the compiled kernel's launcher reads three grid dims
    if not _fast or _interpreted():
        fn[grid](*args, **kwargs)
        return
    # kwargs in call order: a call site passes them in one order (another order only misses the cache)
    key = (id(fn), torch.cuda.current_device(), grid, tuple(kwargs.items()),
           *[(a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a if isinstance(a, (int, float))
             else _desc_key(a) for a in args])
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = fn[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "run"):
            names, defaults = _params(fn)
            # the rest of the argument list kernel[grid] passes to the compiled kernel: every remaining parameter
            # in signature order, defaults filled in (options such as num_warps are not parameters)
            _COMPILED[key] = (compiled, [kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):]])
        return
    compiled, tail = hit
    try:
        compiled[grid](*args, *tail)
    except Exception as e:  # noqa: BLE001 - a Triton whose compiled-kernel launcher wants other arguments
        _fast = False
        log.warning("fp4dispatch: direct launch of a compiled Triton kernel failed (%s: %s); using kernel[grid] "
                    "from now on", type(e).__name__, e)
        fn[grid](*args, **kwargs)
