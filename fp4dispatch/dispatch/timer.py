"""The only place that times kernels. Returns milliseconds (median), like ``triton.testing.do_bench``."""
from __future__ import annotations

import gc
import logging
import statistics
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Callable

import torch

from .verify import reset_cuda_error

__all__ = ["default_do_bench", "cuda_graph_do_bench", "for_device", "screen_for_device", "DoBench", "SCREEN_REP_MS",
           "GRAPH_REP_MS", "EAGER_REP_MS"]

log = logging.getLogger("fp4dispatch")
DoBench = Callable[[Callable[[], object]], float]
# milliseconds of work per measurement of the full timers: a graph replay repeats the call that long (Triton's own
# default for do_bench_cudagraph; each of its ten measurements is one replay); eager launches vary more and get more
GRAPH_REP_MS, EAGER_REP_MS = 20, 40
# the screen timer's: ranks a key's candidates in a fraction of the time, closely enough to pick the few that the
# full timer then decides between (docs/tuning.md)
SCREEN_REP_MS = 5


def _cpu_bench(fn: Callable[[], object], budget_s: float = 0.05, max_reps: int = 50) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < budget_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def for_device(device: torch.device, mode: str = "graph") -> DoBench:
    """The default timer for work on ``device``: on CUDA, GPU time of CUDA-graph replays (``mode="graph"``) or
    eager launches (``mode="eager"``, launch overhead included); a perf_counter loop on the CPU."""
    if device.type != "cuda":
        return _cpu_bench
    return cuda_graph_do_bench if mode == "graph" else default_do_bench


def screen_for_device(device: torch.device, mode: str = "graph") -> DoBench:
    """``for_device``'s timer with ``SCREEN_REP_MS`` of work per measurement: the tuner's first, brief ranking."""
    if device.type != "cuda":
        return _cpu_bench
    if mode == "graph":
        return lambda fn: cuda_graph_do_bench(fn, rep=SCREEN_REP_MS)
    return lambda fn: default_do_bench(fn, rep=SCREEN_REP_MS)


def default_do_bench(fn: Callable[[], object], rep: int = EAGER_REP_MS) -> float:
    """Median time of ``fn`` in ms on CUDA, launched eagerly: ``triton.testing.do_bench`` (CUDA events, L2 flushed),
    else a loop of CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _cuda_event_bench(fn)
    return float(do_bench(fn, warmup=min(10, rep), rep=rep, return_mode="median"))


def cuda_graph_do_bench(fn: Callable[[], object], rep: int = GRAPH_REP_MS) -> float:
    """Median GPU time of ``fn`` in ms from CUDA-graph replays (``_graph_replays``).

    Small-M kernels last about as long as their launches from Python, so eager timings of them move with CPU load
    (the same config measured 25-47 us in one H200 run, 20 us in a graph every time) and rank configs by launch count
    as much as by kernel speed; inference engines replay decode steps from CUDA graphs anyway. A ``fn`` that cannot
    be captured is timed eagerly instead.
    """
    eager_rep = EAGER_REP_MS if rep >= GRAPH_REP_MS else rep  # the full timer falls back to the eager one
    from ..kernels import workspace

    # the split-K counters of the capture stream exist before capture, as after fp4dispatch.warmup()
    workspace.prepare_capture(torch.device("cuda"))
    try:
        with warnings.catch_warnings(), _no_cyclic_gc():  # a refused capture ends an empty graph: torch warns of it
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            return _graph_replays(fn, rep)
    except Exception as e:  # noqa: BLE001 - capture refused (a sync or an allocation pattern): time it eagerly
        log.debug("fp4dispatch: capture refused (%s: %s); timed eagerly", type(e).__name__, str(e)[:200])
        reset_cuda_error(torch.device("cuda"))
    # The refused graph may sit in a reference cycle (the failed frames, through the traceback): freed now, not by a
    # collection inside a later capture (ours, or the caller's own graphs'), whose destroying it would void. All of
    # the cycle was made with the collector paused, so it is young: the youngest generations are enough (a full
    # collection takes a tenth of a second in a process that imported torch and Triton; this one, milliseconds).
    gc.collect(1)
    return default_do_bench(fn, rep=eager_rep)


def _graph_replays(fn: Callable[[], object], rep: int, replays: int = 10) -> float:
    """``triton.testing.do_bench_cudagraph``'s measurement: one call's time estimated from five eager ones, as many
    calls as fill ``rep`` ms captured in one graph, the median of ``replays`` replays per call. Not that function
    itself: it captures in torch's default ``global`` mode, under which a CUDA call that may synchronize (a
    ``cudaMalloc``, say) made by *another* thread during the capture fails and voids the capture. The tuner
    checks and screens a key's Triton candidates while a library's first run compiles in a thread beside it
    (key_compiles.py), and a caller may run threads of its own: this capture is ``thread_local``, which forbids such
    calls to the capturing thread only. Waits on its own stream's events, not the device."""
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()  # warm-up: compiles and loads what the capture must not
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        estimate = start.elapsed_time(end) / 5
        n = max(1, int(rep / estimate)) if estimate > 0 else 1000
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(n):
                fn()
        times = []
        for _ in range(replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


_gc_lock = threading.Lock()
_gc_paused = 0  # captures in progress that paused the collector
_gc_resume = False  # whether the collector was on when the first of them paused it


@contextmanager
def _no_cyclic_gc():
    """Python's cyclic collector paused for the body. ``torch.cuda.graph`` collects before it captures only with
    ``torch.compiler.config.force_cudagraph_gc``, so a collection could run inside a capture and free an object of a
    reference cycle whose destructor makes a call that a capture forbids (a dead ``CUDAGraph``'s reset): the capture
    fails, the candidate is timed eagerly (mis-ranked), and the next launch fails. Counted, so that two threads'
    captures overlap safely; the collector is left as the caller had it."""
    global _gc_paused, _gc_resume
    with _gc_lock:
        if _gc_paused == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused -= 1
            if _gc_paused == 0 and _gc_resume:
                gc.enable()


def _cuda_event_bench(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)
