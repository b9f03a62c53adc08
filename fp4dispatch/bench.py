"""The only place that times kernels. Returns milliseconds (median), like ``triton.testing.do_bench``."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["default_do_bench", "for_device", "DoBench"]

DoBench = Callable[[Callable[[], object]], float]


def _cpu_bench(fn: Callable[[], object], budget_s: float = 0.05, max_reps: int = 50) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < budget_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def for_device(device: torch.device) -> DoBench:
    """The default timer for work on ``device``."""
    return default_do_bench if device.type == "cuda" else _cpu_bench


def default_do_bench(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in ms on CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed), else a loop of
    CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _cuda_event_bench(fn)
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


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
