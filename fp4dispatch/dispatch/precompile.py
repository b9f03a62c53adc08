"""Compile the candidates' kernels before they are checked: all at once instead of one after another.

Two kinds of backend compile on their first run. A Triton backend (``compiles_ahead``) runs each config inside
``runtime.compiles_ahead``, which launches no kernel that still needs compiling and hands its compile to Triton's
async compile mode on a thread pool (a Triton compile is mostly MLIR passes and ptxas, outside the GIL); those runs
take scratch operands whose values do not matter, since a kernel compiled before does run. A library that compiles
a new shape's kernels in its first call (``compiles_on_first_run``: Humming, whose compiler runs in subprocesses) is
run once per ``first_run_unit`` (Humming's: a dense shape's M bucket), for real, in threads beside them. A backend
that runs other backends (``inner_problems``: the per-expert loop of ``fp4_grouped_mm``, whose dense calls are decided
by priority inside its check, one new M bucket after another) has their first configs compiled the same way, at
each dense problem it may call. A run that raises here raises again in its check, which reports it.

``key_compiles.compile_ahead`` does this for one key (the tuner's compile phase, beside the key's checks);
``compile_keys_ahead`` for many keys at once
(``Dispatcher.compile_keys``: ``warmup`` and ``python -m fp4dispatch.tune``), so that a model's keys compile together
and are then timed one by one; ``compiling_keys`` does that while its body times the first keys.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch

from ..backends.base import Backend, Config, config_id
from ..errors import describe_exception
from ..problem import Problem
from .verify import make_case, reset_cuda_error

__all__ = ["compile_keys_ahead", "compiling_keys", "KeyCompiles", "compile_together", "first_run_jobs", "inner_jobs",
           "scratch_ops", "split_pairs", "run_pairs", "first_run", "on_device", "compile_workers", "FIRST_RUN_THREADS"]

log = logging.getLogger("fp4dispatch")
FIRST_RUN_THREADS = 8  # first runs at once (each compiles its unit's few kernels in parallel already)


def compile_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def on_device(device: torch.device):
    """``device`` made current in this thread: a thread starts on CUDA device 0, and Triton compiles and caches a
    kernel for the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def run_pairs(problem: Problem, ops, pairs: list[tuple[Backend, Config]]) -> None:
    for b, cfg in pairs:
        try:
            b.run(problem, ops, cfg)
        except Exception as e:  # noqa: BLE001 - its check runs it again and reports the failure
            log.debug("precompile %s[%s] for %s: %s", b.name, config_id(cfg), problem, describe_exception(e))


def first_run(problem: Problem, make_ops: Callable[[], object], pair: tuple[Backend, Config]) -> float:
    """One first run; returns when it ended (``time.perf_counter()``). Its operands' making and its run are logged
    (DEBUG) with their seconds: what a cold tune waits for in a library's first runs. It waits for its own stream, not
    the device: the tuner may be capturing a graph in another thread meanwhile (``key_compiles.FirstRuns``)."""
    t0 = time.perf_counter()
    with on_device(problem.device):
        try:
            ops = make_ops()  # here, not when listed: only the units running now hold operands (large shapes' are big)
        except Exception as e:  # noqa: BLE001 - out of memory, say: its check runs it again and reports it
            log.debug("precompile %s for %s: %s", pair[0].name, problem, describe_exception(e))
            return time.perf_counter()
        t1 = time.perf_counter()
        run_pairs(problem, ops, [pair])
        try:
            if problem.device.type == "cuda":
                torch.cuda.current_stream(problem.device).synchronize()
        except Exception:  # noqa: BLE001 - a fault is reset by the caller and found again by the check
            pass
    end = time.perf_counter()
    log.debug("fp4dispatch: first run of %s for %s: operands %.2f s, run %.2f s", pair[0].name, problem, t1 - t0,
              end - t1)
    return end


def compile_together(ahead: list[tuple[Problem, Callable[[], object], list]],
                     first: list[tuple[Problem, object, tuple]], *, handed_out: Callable[[], None] | None = None,
                     compiled: Callable[[Problem], None] | None = None, processes=None,
                     seconds: dict | None = None) -> None:
    """Triton compiles of ``ahead`` ((problem, scratch operands maker, pairs)) on a pool (in the compile worker
    ``processes`` first, if given: ``runtime.compiles_ahead``), while ``first`` ((problem, operands maker, pair))
    run in threads. ``handed_out()``, if given, is called once every compile is handed out and every first run is
    over; then the compiles are waited for in ``ahead``'s order (the pool's), and
    ``compiled(problem)`` is called once the kernels of that problem's pairs are in Triton's cache. Without
    ``handed_out`` the compiles are waited for first, so that ``seconds`` (if given) gets how long each side took
    from the start: ``triton`` (handing out and waiting for the compiles) and ``first_runs``."""
    from ..kernels import runtime

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(FIRST_RUN_THREADS, thread_name_prefix="fp4dispatch-first-run") if first else None
    futures = [pool.submit(first_run, *job) for job in first] if pool else []
    try:
        with runtime.compiles_ahead(compile_workers() if ahead else 0, processes) as ctx:
            handed = []
            for problem, make_ops, pairs in ahead if ctx.active else ():
                handed.append((problem, ctx.collect()))
                with on_device(problem.device):
                    run_pairs(problem, make_ops(), pairs)
            if handed_out is not None:
                for f in futures:
                    f.result()
                handed_out()
            for problem, kernels in handed:
                runtime.finish(kernels)
                if compiled is not None:
                    compiled(problem)
            t1 = time.perf_counter()
            ends = [f.result() for f in futures]  # when each first run ended
            if seconds is not None:
                seconds.update(triton=t1 - t0, first_runs=max(ends, default=t0) - t0)
    finally:
        if pool is not None:
            for f in futures:
                f.result()
            pool.shutdown()


def split_pairs(pairs: list[tuple[Backend, Config]]) -> tuple[list, list]:
    """(the pairs whose backend compiles ahead, the first pair of each backend that compiles on its first run)"""
    ahead = [(b, c) for b, c in pairs if getattr(b, "compiles_ahead", False)]
    first, seen = [], set()
    for b, c in pairs:
        if getattr(b, "compiles_on_first_run", False) and b.name not in seen:
            first.append((b, c))
            seen.add(b.name)
    return ahead, first


def inner_jobs(backends, problem: Problem, seen: set | None = None) -> list[tuple[Problem, Callable, list]]:
    """``compile_together``'s ``ahead`` jobs (scratch operands) for the backends that run other backends on
    ``problem`` (``inner_problems``: the per-expert loop's dense calls, decided by priority, so each backend's first
    config at each problem), less the (problem, config) pairs in ``seen``, which this adds to. Anything that raises is
    left to the checks, which report it."""
    jobs = []
    seen = set() if seen is None else seen
    for outer in backends:
        try:
            inner = outer.inner_problems(problem) if hasattr(outer, "inner_problems") else []
        except Exception:  # noqa: BLE001
            continue
        for p, candidates in inner:
            pairs = []
            for b in candidates:
                try:
                    cfgs = [] if not getattr(b, "compiles_ahead", False) or b.unsupported(p) else b.configs(p)[:1]
                except Exception:  # noqa: BLE001
                    continue
                pairs += [(b, c) for c in cfgs if (p.key, b.name, config_id(c)) not in seen]
                seen.update((p.key, b.name, config_id(c)) for c in cfgs)
            if pairs:
                jobs.append((p, lambda p=p: scratch_ops(p), pairs))
    return jobs


def compile_keys_ahead(jobs: list[tuple[Problem, list[Backend]]], handed_out: Callable[[], None] | None = None,
                       compiled: Callable[[Problem], None] | None = None, processes=None) -> None:
    """Many keys ((problem, candidate backends) each): every Triton config of every key, and each first-run library
    once per ``first_run_unit`` (``first_run_jobs``), all at once. Scratch operands are made per key as its compiles
    are handed out, and per first run as it starts. ``handed_out``, ``compiled``, ``processes``: ``compile_together``'s;
    the kernels launched on scratch operands have finished when ``handed_out`` is called."""
    jobs = [j for j in jobs if j[0].device.type == "cuda"]
    ahead, libraries = [], {}
    start, spent = time.perf_counter(), 0.0  # spent: making the scratch operands of ``ahead``

    def scratch(p: Problem):
        nonlocal spent
        t = time.perf_counter()
        try:
            return scratch_ops(p)
        finally:
            spent += time.perf_counter() - t

    seen: set = set()  # the inner jobs' (problem, backend, config): the loop of several keys meets the same ones
    inner = 0  # of ``ahead``: the loops' dense calls
    for problem, candidates in jobs:
        # before the key's own: waiting for the key's compiles (in ``ahead``'s order) then covers its loop's too
        loop = [(p, lambda p=p: scratch(p), pairs) for p, _, pairs in inner_jobs(candidates, problem, seen)]
        ahead += loop
        inner += len(loop)
        pairs = []
        for b in candidates:
            if getattr(b, "compiles_on_first_run", False):
                libraries.setdefault(b.name, (b, []))[1].append(problem)
            elif getattr(b, "compiles_ahead", False):
                try:
                    pairs += [(b, c) for c in b.configs(problem)]
                except Exception:  # noqa: BLE001 - the key's own tune reports it
                    continue
        if pairs:
            ahead.append((problem, lambda p=problem: scratch(p), pairs))
    first = [(p, lambda p=p: scratch_ops(p), (b, cfg))
             for b, problems in libraries.values() for p, cfg in first_run_jobs(b, problems)]
    if not (ahead or first):
        return
    devices = {j[0].device for j in jobs}
    settled = []  # set once the CUDA work is over: none after that (the caller may be capturing a CUDA graph)

    def over() -> None:
        for dev in devices:
            reset_cuda_error(dev)
        settled.append(True)
        log.info("fp4dispatch: handed out the compiles of %d configs of %d keys%s and made %d first runs in %.1f s "
                 "(scratch operands: %.1f s)", sum(len(a[2]) for a in ahead), len(ahead) - inner,
                 f" and {inner} dense calls of their loops" if inner else "", len(first), time.perf_counter() - start,
                 spent)
        handed_out()
        if compiled is not None:  # the keys with nothing to compile ahead: nothing to wait for
            with_pairs = {id(p) for p, _, _ in ahead}
            for p, _ in jobs:
                if id(p) not in with_pairs:
                    compiled(p)

    try:
        compile_together(ahead, first, handed_out=over if handed_out is not None else None, compiled=compiled,
                         processes=processes)
    finally:
        for dev in devices if not settled else ():
            reset_cuda_error(dev)


class KeyCompiles:
    """``compiling_keys``' handle: ``wait(key)`` returns once the kernels handed out for that key are in Triton's
    cache (at once for a key it was not given, and once the compiles are over or have failed)."""

    def __init__(self, keys):
        self._events = {key: threading.Event() for key in keys}

    def wait(self, key: tuple) -> None:
        event = self._events.get(key)
        if event is not None:
            event.wait()

    def _done(self, key: tuple) -> None:
        event = self._events.get(key)
        if event is not None:
            event.set()

    def _all_done(self) -> None:
        for event in self._events.values():
            event.set()


@contextmanager
def compiling_keys(jobs: list[tuple[Problem, list[Backend]]], processes=None):
    """``compile_keys_ahead(jobs, processes=processes)`` while the body runs: entering returns once every compile is
    handed out and every first run is over, and yields a :class:`KeyCompiles`, whose ``wait(key)`` returns once
    that key's kernels are compiled: the body can check and time a model's first keys while its last ones compile.
    The compiles are handed out, and waited for key by key in the order of ``jobs`` (the pool's), by a thread of its
    own; that thread's CUDA calls (scratch operands, runs on them, first runs) are over before the body starts, so
    that none can spoil a CUDA graph that the body captures. Leaving waits for the rest of the compiles."""
    compiles = KeyCompiles(p.key for p, _ in jobs)
    handed_out = threading.Event()
    failed: list[BaseException] = []

    def hand_out() -> None:
        try:
            compile_keys_ahead(jobs, handed_out.set, lambda p: compiles._done(p.key), processes)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(e)
        finally:
            handed_out.set()
            compiles._all_done()

    worker = threading.Thread(target=hand_out, name="fp4dispatch-compile-keys", daemon=True)
    worker.start()
    try:
        handed_out.wait()
        if not failed:  # else handing out raised: no body
            yield compiles
    except BaseException:
        worker.join()
        if failed:  # the body's error goes up; the worker's is logged
            log.warning("fp4dispatch: compiling keys ahead failed too (%s)", describe_exception(failed[0]))
        raise
    worker.join()
    if failed:
        raise failed[0]


def first_run_jobs(backend: Backend, problems) -> list[tuple[Problem, Config]]:
    """One (problem, config) per ``first_run_unit`` of ``backend`` over ``problems``: at the unit's smallest M, the
    first config offered there. A problem that the backend refuses (at its M or its bucket's largest), or whose
    configs raise, is left to its key's own tune, which reports it."""
    units: dict[tuple, tuple[Problem, Config]] = {}
    for p in sorted(problems, key=lambda p: p.m):
        try:
            if backend.unsupported(p) or backend.unsupported(p.with_m(p.bucket)):
                continue
            configs, unit = backend.configs(p), backend.first_run_unit(p)
        except Exception:  # noqa: BLE001
            continue
        if configs and unit not in units:
            units[unit] = (p, configs[0])
    return list(units.values())


def scratch_ops(problem: Problem, seed: int = 0):
    """Operands of ``problem`` for a run whose result nothing checks (no exact result is computed)."""
    return make_case(problem, seed, lambda p, ops: None).ops
