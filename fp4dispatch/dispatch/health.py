"""Every backend's verdict on one device: from the cache, else probed now (risky ones in worker processes)."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from .cache import DecisionCache
from ..settings import Settings
from .isolate import probe_isolated
from .probe import probe_backend
from ..problem import m_bucket
from .records import Verdict

__all__ = ["device_health", "wrong_in_bucket", "wrong_when_probed"]

log = logging.getLogger("fp4dispatch")


def device_health(backends, device: torch.device, cache: DecisionCache, settings: Settings) -> dict[str, Verdict]:
    """Verdicts for ``backends`` on ``device``; new ones are written to ``cache`` (transient ones are not)."""
    health: dict[str, Verdict] = {}
    fresh = {}
    isolated, local = [], []
    for b in backends:
        if b.name in settings.disabled:
            health[b.name] = Verdict("unavailable", "disabled by FP4DISPATCH_DISABLE")
        elif (cached := cache.health.get(b.name)) is not None:
            health[b.name] = Verdict.from_json(cached)  # checked when the file was read
        elif settings.isolate and b.risky and b.unavailable(device) is None:
            isolated.append(b)
        else:
            local.append(b)
    # the workers start first and run while this process probes the others: a worker's start-up and a library's
    # first compile (Humming's) overlap the in-process probes instead of following them
    pool = ThreadPoolExecutor(max_workers=len(isolated)) if isolated else None
    futures = [pool.submit(probe_isolated, b, device, max(settings.probe_timeout_s, getattr(b, "probe_timeout_s", 0.0)))
               for b in isolated]  # a backend that compiles its kernels when first run asks for more time
    try:
        # in process: safe backends first, risky ones last (isolation off): a crash must not take the safe verdicts
        for b in sorted(local, key=lambda b: bool(b.risky)):
            health[b.name] = fresh[b.name] = probe_backend(b, device)
    finally:
        for b, f in zip(isolated, futures):
            health[b.name] = v = f.result()
            if not v.transient:  # a timeout may be a one-off JIT compile: probe again next process
                fresh[b.name] = v
        if pool is not None:
            pool.shutdown()
    for name, v in health.items():
        if name in fresh or v.transient:
            log.info("fp4dispatch: probe %s on %s: %s %s", name, device, v.status, v.reason)
    if fresh:
        cache.update("health", {n: v.to_json() for n, v in fresh.items()})
    return health


def wrong_in_bucket(v: Verdict, bucket: int) -> int | None:
    """A probe M at which the backend was wrong and that falls in M bucket ``bucket``, or None."""
    return next((m for m in v.wrong_ms if m_bucket(m) == bucket), None)


def wrong_when_probed(v: Verdict, bucket: int) -> str | None:
    """Why a backend whose probe was wrong at an M of ``bucket`` may not serve that bucket's key, or None."""
    m = wrong_in_bucket(v, bucket)
    return f"incorrect at M={m} when probed (M bucket {bucket} holds it): {v.reason}" if m else None
