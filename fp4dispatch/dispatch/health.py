"""Every backend's verdict on one device: from the cache, else probed now (risky ones in worker processes)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..backends.base import computes
from .cache import DecisionCache
from .precompile import first_run_jobs
from ..settings import Settings
from .isolate import probe_isolated
from .probe import describe_exception, probe_backend
from ..problem import m_bucket
from .records import Verdict

__all__ = ["device_health", "wrong_in_bucket", "wrong_when_probed"]

log = logging.getLogger("fp4dispatch")
# added to a worker's timeout per upcoming first run: each compiles a few kernels, FIRST_RUN_THREADS of them at once
UPCOMING_RUN_S = 10.0


def device_health(backends, device: torch.device, cache: DecisionCache, settings: Settings, *, upcoming=(),
                  meanwhile: Callable[[dict[str, Verdict]], None] | None = None) -> dict[str, Verdict]:
    """Verdicts for ``backends`` on ``device``; new ones are written to ``cache`` (transient ones are not).

    ``upcoming``: problems about to be decided. A worker that probes a library compiling on its first run (Humming)
    also makes their first runs (``precompile.first_run_jobs``), so the library's disk cache holds their kernels
    when this process runs them. ``meanwhile(verdicts)`` is called once the in-process verdicts are known, when
    there are workers to wait for: the caller compiles the safe backends' kernels while they work (an exception
    there is logged, not raised: it was a head start)."""
    health: dict[str, Verdict] = {}
    fresh = {}
    isolated, local, check_here = [], [], set()
    for b in backends:
        if b.name in settings.disabled:
            health[b.name] = Verdict("unavailable", "disabled by FP4DISPATCH_DISABLE")
        elif (cached := cache.health.get(b.name)) is not None:
            health[b.name] = Verdict.from_json(cached)  # checked when the file was read
        elif settings.isolate and b.risky and _starts_first(b, device):
            isolated.append(b)
            check_here.add(b.name)
        elif settings.isolate and b.risky and b.unavailable(device) is None:
            isolated.append(b)
        else:
            local.append(b)
    # the workers start first and run while this process probes the others: a worker's start-up and a library's
    # first compile (Humming's) overlap the in-process probes instead of following them
    pool = ThreadPoolExecutor(max_workers=len(isolated)) if isolated else None
    cancel = threading.Event()
    futures = [pool.submit(_probe_in_worker, b, device, settings, upcoming, cancel, b.name in check_here)
               for b in isolated]
    try:
        # in process: safe backends first, risky ones last (isolation off): a crash must not take the safe verdicts
        for b in sorted(local, key=lambda b: bool(b.risky)):
            health[b.name] = v = probe_backend(b, device)
            if not v.transient:  # short of memory: probed again next process
                fresh[b.name] = v
        if meanwhile is not None and isolated:  # with no worker to wait for, the caller compiles after this
            try:
                meanwhile(dict(health))
            except Exception as e:  # noqa: BLE001 - a head start only: the caller compiles what is left
                log.warning("fp4dispatch: compiling beside the probe workers failed (%s)", describe_exception(e))
        for b, f in zip(isolated, futures):
            health[b.name] = v = f.result()
            if not v.transient:  # a timeout may be a one-off JIT compile: probe again next process
                fresh[b.name] = v
    except BaseException:
        cancel.set()  # interrupted (Ctrl-C): the workers are killed, not waited for until their timeouts
        raise
    finally:
        if pool is not None:
            pool.shutdown()
    for name, v in health.items():
        if name in fresh or v.transient:
            log.info("fp4dispatch: probe %s on %s: %s %s", name, device, v.status, v.reason)
    if fresh:
        cache.update("health", {n: v.to_json() for n, v in fresh.items()})
    return health


def _starts_first(b, device: torch.device) -> bool:
    """Whether ``b``'s probe worker starts before this process imports its library (``probe_isolated``'s
    ``check_here``): a library that compiles on its first run (Humming), whose worker (its probe and the upcoming
    keys' first runs) is the longest part of a cold tune and whose import alone takes seconds, unless what is known
    without the import (``unavailable_before_import``: the GPU, whether it is installed) rules it out."""
    before = getattr(b, "unavailable_before_import", None)
    if not getattr(b, "compiles_on_first_run", False) or before is None:
        return False
    try:
        return before(device) is None
    except Exception:  # noqa: BLE001 - unavailable() words it
        return False


def _probe_in_worker(b, device: torch.device, settings: Settings, upcoming, cancel: threading.Event,
                     check_here: bool = False) -> Verdict:
    """``probe_isolated`` with the upcoming first runs of a first-run library; its timeout grows with them (and is
    at least the backend's own ``probe_timeout_s``: a library that compiles its kernels when first run asks more)."""
    jobs = first_run_jobs(b, [p for p in upcoming if p.device == device and computes(b, p.op)]) \
        if getattr(b, "compiles_on_first_run", False) else []
    timeout_s = max(settings.probe_timeout_s, getattr(b, "probe_timeout_s", 0.0)) + UPCOMING_RUN_S * len(jobs)
    return probe_isolated(b, device, timeout_s, tuple(p for p, _ in jobs), cancel=cancel, check_here=check_here)


def wrong_in_bucket(v: Verdict, bucket: int) -> int | None:
    """A probe M at which the backend was wrong and that falls in M bucket ``bucket``, or None."""
    return next((m for m in v.wrong_ms if m_bucket(m) == bucket), None)


def wrong_when_probed(v: Verdict, bucket: int) -> str | None:
    """Why a backend whose probe was wrong at an M of ``bucket`` may not serve that bucket's key, or None."""
    m = wrong_in_bucket(v, bucket)
    return f"incorrect at M={m} when probed (M bucket {bucket} holds it): {v.reason}" if m else None
