"""What every kernel launch needs on the host: the interpreter switch, device queries (index, SM count, PDL), K
split arithmetic, TMA descriptors, and :func:`launch`, which launches a ``@triton.jit`` (or Gluon) kernel with less
host time per call than ``kernel[grid](...)``.

On every call, ``kernel[grid](...)`` binds the arguments, specializes each one (alignment of each pointer,
divisibility of each int), builds a cache key from that and only then finds the compiled kernel; on a fast GPU that
is most of an eager small-M call. ``launch`` keeps the compiled kernel that the first call returns under a key that
holds everything those steps read, so it never needs Triton's specialization rules: the value of every positional
argument (of a tensor: its dtype and its address mod 16, Triton's alignment specialization; of a TMA descriptor: the
same of its base, its block shape and layout), the keyword arguments (constexprs and launch options: scalars), the
grid and the device. A later call with an equal key launches that compiled kernel directly, with the argument list
``kernel[grid]`` would pass it (every parameter in signature order, defaults filled in). If a direct launch refuses
its argument list (TypeError), the fast path is switched off for the process and the call goes through
``kernel[grid]``; any other error (a CUDA one) propagates as ``kernel[grid]``'s would, and the fast path stays.
There is one entry per distinct key (e.g. per M a model runs with); the entries share the compiled kernels.
``plan.py`` goes further for a whole ``fp4_mm`` call: it records the launches once (``recording``) and replays them
through the compiled kernels' launchers with only the addresses bound.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading

import torch

from .cache_keys import settle

__all__ = ["interpreting", "jit_interpreted", "cuda_index", "cdiv", "num_sms", "k_split", "pdl", "register_cap",
           "launch", "tma_desc", "Address", "recording", "note_buffer", "launch_hooks_set",
           "raw_stream", "capturing", "direct_launcher", "compiling_ahead", "compiles_ahead", "pending", "finish",
           "can_hand_out"]

log = logging.getLogger("fp4dispatch")

_COMPILED: dict[tuple, tuple[object, list]] = {}
_PARAMS: dict[int, tuple[object, list[str], dict]] = {}  # id(fn) -> (fn, parameter names, defaults)
_fast = True
_SMS: dict[int, int] = {}
_tls = threading.local()  # .rec: the list a launch plan is being recorded into on this thread (plan.py), or None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


@functools.cache
def jit_interpreted() -> bool:
    """``interpreting()`` read once: Triton fixes interpret-or-compile when the ``@triton.jit`` functions are defined,
    so the launch paths (per layer, per token) need not read the environment again. Callers look it up as
    ``runtime.jit_interpreted`` at call time, so that tests can patch it."""
    return interpreting()


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` ("cuda" means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def raw_stream(idx: int) -> int:
    """The handle of the current CUDA stream of device ``idx`` (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(idx)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_current_stream_capturing()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached); 8 for a non-CUDA device (the interpreter)."""
    if device.type != "cuda":
        return 8
    idx = cuda_index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def k_split(kb: int, k_blocks: int, split: int) -> tuple[int, int]:
    """(parts, 16-blocks per part) of a K of ``kb`` blocks cut into at most ``split`` parts of whole K steps: the part
    length is a multiple of ``k_blocks``, which the kernels rely on (``tiles.k_part``)."""
    per = cdiv(cdiv(kb, split), k_blocks) * k_blocks
    return cdiv(kb, per), per


@functools.cache
def _pdl_capable(idx: int) -> bool:
    from .tiles import HAS_GDC

    return HAS_GDC and torch.cuda.get_device_capability(idx) >= (9, 0)


def pdl(device: torch.device, enabled: bool) -> dict:
    """Launch options for programmatic dependent launch (SM90+): the kernel is launched while the previous one on the
    stream finishes and waits for its writes in ``tiles.pdl_wait``, which hides a launch's latency in a CUDA graph.
    ``enabled`` False (a config's ``pdl``) turns it off, so that benchmarks can compare both."""
    if not enabled or device.type != "cuda" or jit_interpreted():
        return {}
    return {"launch_pdl": True, "PDL": True} if _pdl_capable(cuda_index(device)) else {}


def register_cap(max_registers: int | None) -> dict:
    """The ``maxnreg`` launch option (registers per thread: more resident warps); the interpreter has none."""
    return {"maxnreg": max_registers} if max_registers is not None and not jit_interpreted() else {}


def _params(fn) -> tuple[list[str], dict]:
    """Parameter names in signature order, and the defaults."""
    got = _PARAMS.get(id(fn))
    if got is None:
        sig = fn.signature.parameters  # JITFunction keeps the inspect.Signature of the Python function
        # the entry holds fn itself: while it is here, no other object can be given fn's id
        got = _PARAMS[id(fn)] = (fn, list(sig), {n: p.default for n, p in sig.items() if p.default is not p.empty})
    return got[1], got[2]


class Address:
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
    tensor map, whatever tensor lies there now: a view plus ``TensorDescriptor.from_tensor`` cost more host time than
    the rest of a small call, and the Gluon kernels pass two to four per call."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(Address(ptr, dtype), list(shape), list(strides), list(block), layout)


def _desc_key(a):
    """A host TMA descriptor (Triton's or Gluon's ``TensorDescriptor``) by what types the compiled kernel: dtype, base
    alignment, block shape and layout (its launcher builds the tensor map from the rest on every call); any other
    argument as itself."""
    base = getattr(a, "base", None)
    if hasattr(base, "data_ptr") and hasattr(base, "dtype") and hasattr(a, "block_shape"):  # a tensor or Address
        return ("desc", base.dtype, base.data_ptr() % 16, tuple(a.block_shape), getattr(a, "layout", None))
    return a


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is set (a profiler such as proton): each launch must then go through Triton's
    own path, which calls them. Triton 3.6 keeps the hooks in (possibly empty) chains; older ones hold a function or
    None."""
    k = _runtime_knobs()
    for hook in (k.launch_enter_hook, k.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def recording(rec: list | None) -> None:
    """Start (``rec``, a list) or stop (None) recording this thread's launches and scratch buffers: ``launch``
    appends ``("launch", compiled kernel or None, grid, args, remaining parameters)``, ``note_buffer`` appends
    ``("buffer", address, request)``. ``plan.record`` turns the list into a launch plan."""
    _tls.rec = rec


def note_buffer(t: torch.Tensor, request: tuple) -> None:
    """Tell a recording (if any) that ``t`` is scratch obtained with ``request`` (``workspace``'s)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.append(("buffer", t.data_ptr(), request))


def compiling_ahead() -> bool:
    """Whether this thread is inside ``compiles_ahead``: ``launch`` then compiles and launches nothing."""
    return getattr(_tls, "ahead", False)


def can_hand_out() -> bool:
    """Whether compiles can be handed out ahead of launches (``compiles_ahead``): Triton compiles (no interpreter)
    and has async compile (a Triton before it compiles every kernel at its first launch)."""
    if jit_interpreted():
        return False
    try:
        return importlib.util.find_spec("triton.runtime._async_compile") is not None
    except ImportError:  # no Triton
        return False


class compiles_ahead:
    """Within this context, ``launch`` of a kernel not yet compiled for its arguments launches nothing: it hands the
    compile to Triton's async compile mode (``triton.runtime._async_compile.AsyncCompileMode``) on a pool of
    ``workers`` threads, so that the configs of one tuning key compile at the same time; with ``processes``
    (compile_processes.py's workers) each compile is done in a worker process first, out of this process's GIL,
    and then read from Triton's disk cache on those threads. A kernel already compiled is launched as usual (the hot
    path reads no flag), which is why callers pass scratch operands.
    Leaving the context waits for every compile; a compile that fails is left for the first real launch to raise.
    Until a compile is waited for, Triton 3.6 keeps its kernel in the async mode only, where a launch from another
    thread does not find it (and compiles it again); later Tritons put a placeholder in the kernel cache, which such
    a launch would wait on. ``collect`` and ``finish`` wait for some compiles earlier, in the handing-out thread, so
    that another thread can launch those kernels while the rest still compile (``precompile.compiling_keys``).
    ``active`` is False (and the context does nothing) where this cannot work: the interpreter, or a Triton without
    async compile; or with no ``workers``; or inside another one in this thread. Callers run each candidate once
    inside, on operands whose values do not matter."""

    def __init__(self, workers: int, processes=None):
        self.workers, self.processes, self.active, self._mode, self._pool = workers, processes, False, None, None

    def __enter__(self) -> "compiles_ahead":
        if self.workers < 1 or not can_hand_out():
            return self
        from triton.runtime._async_compile import AsyncCompileMode, active_mode

        # inside another one in this thread (handing out, or ``launching``: a probe inside a check), whose async mode
        # serves this one's launches; Triton allows one mode at a time
        if active_mode.get() is not None:
            return self

        from .compile_processes import CompileExecutor

        self._pool = CompileExecutor(self.workers, self.processes)
        self._mode = AsyncCompileMode(self._pool, ignore_errors=True)
        self._mode.__enter__()
        self.active = _tls.ahead = True
        return self

    def collect(self) -> list:
        """The compiles this thread hands out from now on (until the next ``collect`` or the end of the context) are
        appended to the returned list, for ``finish``."""
        _tls.handed = []
        return _tls.handed

    def launching(self) -> None:
        """From now on ``launch`` in this thread launches again, inside the context: a kernel whose compile is still
        pending is waited for first (Triton's async mode, on until the context ends, hands that launch the pending
        compile, not a new one). For a caller that checks each candidate as soon as its own compiles end
        (``key_compiles.TritonCompiles``)."""
        if self.active:
            _tls.ahead, _tls.handed = False, None

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        _tls.ahead, _tls.handed = False, None
        try:
            self._mode.__exit__(None, None, None)
        finally:
            self._pool.shutdown(wait=True)


def _placeholder(kernel) -> bool:
    """Whether ``kernel`` is Triton's placeholder of a compile handed out (``FutureKernel``), not a compiled kernel;
    read on its type: the placeholder resolves other attributes by waiting for the compile."""
    return hasattr(type(kernel), "result")


def _hand_out(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    kernel = fn.warmup(*args, grid=grid, **kwargs)  # Triton's placeholder of the compile, or the kernel compiled before
    handed = getattr(_tls, "handed", None)
    if handed is not None and _placeholder(kernel):
        handed.append(kernel)


def pending(handed: list) -> list:
    """The ``concurrent.futures.Future`` of each compile in ``handed`` that is still running (read from the
    placeholder's own attributes: a later Triton's placeholder resolves any other attribute by waiting)."""
    futures = (vars(kernel).get("future") for kernel in handed)
    return [f for f in futures if f is not None and not f.done()]


def finish(handed: list) -> None:
    """Wait for the compiles of ``handed`` (``compiles_ahead.collect``'s list) and put their kernels in Triton's kernel
    cache, where a launch from any thread finds them. A compile that failed is left out, for the first real launch to
    compile it again and raise its error. Called in the thread that handed them out, before any other thread launches
    those kernels: Triton's placeholder is not meant to be finished from two threads at once."""
    for kernel in handed:
        kernel.result(ignore_errors=True)


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``; from the second call with the same key on, without Triton's argument binding.
    ``args`` are the leading parameters; ``kwargs`` the keyword parameters (constexprs) and launch options
    (``num_warps``, ``launch_pdl``, ...). Inside ``compiles_ahead``: only start the compile of a new kernel."""
    grid = (*grid, *(1,) * (3 - len(grid)))  # the compiled kernel's launcher reads three grid dims
    hit = _launch(fn, grid, args, kwargs)
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        compiled, tail = hit[:2] if hit is not None else (None, None)
        rec.append(("launch", compiled, grid, args, tail))


def direct_launcher(compiled) -> tuple | str:
    """(launcher, function handle, cooperative, pdl, packed metadata): what a compiled kernel's ``[grid]`` runner
    passes its launcher besides the grid, the stream and the arguments, so that a caller can call the launcher
    itself (Triton 3.6's ``CudaLauncher.launch``: the C launcher, wrapped by a closure that expands descriptor
    arguments), or why it cannot."""
    lw = getattr(compiled, "run", None)
    fn = getattr(lw, "launch", None)
    if fn is None or not hasattr(compiled, "function") or not hasattr(compiled, "packed_metadata"):
        return "the compiled kernel has no launcher this module knows"
    if getattr(lw, "global_scratch_size", 1) or getattr(lw, "profile_scratch_size", 1):
        return "the kernel needs global or profiling scratch, which Triton allocates per launch"
    return fn, compiled.function, lw.launch_cooperative_grid, lw.launch_pdl, compiled.packed_metadata


def _launch(fn, grid: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """``launch``'s work; returns (compiled kernel, remaining parameters, ``direct_launcher``'s or None) when the
    compiled kernel was launched with that argument list (so that a launch plan may do the same), else None."""
    global _fast
    interpreted = jit_interpreted()
    if not _fast or interpreted:
        if not interpreted:  # the interpreter has no cache keys
            settle(fn)
        if getattr(_tls, "ahead", False):
            _hand_out(fn, grid, args, kwargs)
        else:
            fn[grid](*args, **kwargs)
        return None
    # kwargs in call order: a call site passes them in one order (another order only misses the cache)
    key = (id(fn), torch.cuda.current_device(), grid, tuple(kwargs.items()),
           *[(a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a if isinstance(a, (int, float))
             else _desc_key(a) for a in args])
    hit = _COMPILED.get(key)
    if hit is None:
        settle(fn)  # its cache key, as every process computes it, before Triton computes it for the compile
        if getattr(_tls, "ahead", False):  # compiles_ahead: start the compile only (read on a miss, not per launch)
            _hand_out(fn, grid, args, kwargs)
            return None
        compiled = fn[grid](*args, **kwargs)
        if _placeholder(compiled):  # a later Triton's, of a compile handed out and finished: keep the kernel
            compiled = compiled.result()
        if compiled is not None and hasattr(compiled, "run"):
            names, defaults = _params(fn)
            # the rest of the argument list kernel[grid] passes to the compiled kernel: every remaining parameter
            # in signature order, defaults filled in (options such as num_warps are not parameters)
            tail = [kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):]]
            direct = direct_launcher(compiled)
            hit = _COMPILED[key] = (compiled, tail, None if isinstance(direct, str) else direct)
        return hit
    compiled, tail, direct = hit
    try:
        if direct is not None and not launch_hooks_set():
            # what compiled[grid] would do, less its per-call closure, device and stream lookups, launch metadata
            # and the calls of Triton 3.6's always-present (empty) hook chains
            run, function, coop, pdl_, packed = direct
            run(*grid, raw_stream(key[1]), function, coop, pdl_, None, None, packed, None, None, None, *args, *tail)
        else:
            compiled[grid](*args, *tail)
    except TypeError as e:  # a Triton whose compiled-kernel launcher wants other arguments (a CUDA error, such as
        # that of a capture voided before this launch, is not about the arguments: it propagates, the fast path stays)
        _fast = False
        log.warning("fp4dispatch: direct launch of a compiled Triton kernel failed (%s: %s); using kernel[grid] "
                    "from now on", type(e).__name__, e)
        fn[grid](*args, **kwargs)
        return None
    return hit
