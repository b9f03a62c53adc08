"""Probe: does a backend run on this device, and is it right? A verdict is data, never an exception.

Statuses: ``ok``, ``unavailable`` (cannot run here: library missing, SM refused), ``unsupported`` (runs here but
refused every probe problem), ``failed`` (raised, crashed or hung; short of device memory: a transient verdict, not
cached), ``incorrect`` (wrong at every probe M).
A backend wrong at only some probe M stays ``ok`` for the device with those M in ``wrong_ms``: the dispatcher keeps
it out of every key whose M bucket holds one of them.
"""
from __future__ import annotations

import logging
import time

import torch

from ..backends.base import Backend, probe_op
from ..backends.reference import reference_mm
from ..errors import describe_exception
from ..problem import Problem
from .precompile import compile_together, first_run_jobs, scratch_ops
from .records import STATUSES, Verdict
from .verify import OUT_OF_MEMORY, PROBE_E, PROBE_K, PROBE_MS, PROBE_N, check_run, make_case, reset_cuda_error

__all__ = ["Verdict", "STATUSES", "probe_backend", "probe_problem", "describe_exception", "reset_cuda_error",
           "unavailable_reason", "memory_verdict"]

log = logging.getLogger("fp4dispatch")


def probe_problem(backend: Backend, m: int, device: torch.device) -> Problem:
    """A probe problem of ``m`` rows in the op the backend is probed on (``probe_op``): packed NVFP4 activations,
    bf16 ones for a W4A16-only backend, ``PROBE_E`` experts for a grouped-only one."""
    op = probe_op(backend)
    return Problem(m, PROBE_N, PROBE_K, torch.bfloat16, device, torch.bfloat16 if op == "w4a16" else torch.uint8,
                   PROBE_E if op == "grouped" else 0)


def unavailable_reason(backend: Backend, device: torch.device) -> str | None:
    """``backend.unavailable(device)``; a check that raises is a reason too."""
    try:
        return backend.unavailable(device)
    except Exception as e:  # noqa: BLE001 - a broken availability check is a verdict too
        return f"availability check raised {describe_exception(e)}"


def probe_backend(backend: Backend, device: torch.device, seed: int = 1234, upcoming: tuple = ()) -> Verdict:
    """Run ``backend`` on the probe problems (fresh hostile random inputs, NaN-poisoned out) against the reference.
    ``upcoming``: problems of keys about to be decided; a first-run library makes their first runs with the probe's
    own before it runs (a worker fills the library's disk cache for its caller that way)."""
    t0 = time.perf_counter()

    def verdict(status: str, reason: str = "", wrong_ms: tuple = ()) -> Verdict:
        return Verdict(status, reason, round(time.perf_counter() - t0, 4), wrong_ms=wrong_ms)

    if why := unavailable_reason(backend, device):
        return verdict("unavailable", why)
    _compile_ahead(backend, device, seed, upcoming)
    wrong: dict[int, str] = {}
    refused: list[str] = []
    ran = 0
    for i, m in enumerate(PROBE_MS):
        problem = probe_problem(backend, m, device)
        try:
            why = backend.unsupported(problem)
            configs = backend.configs(problem) if not why else []
        except Exception as e:  # noqa: BLE001
            return verdict("failed", f"{describe_exception(e)} (asked about M={m})")
        if why or not configs:
            refused.append(why or "offers no config")
            continue
        case = make_case(problem, seed + i, reference_mm)
        # the first config that runs decides; a backend fails only if every config raises
        outcome = None
        for cfg in configs:
            outcome = check_run(backend, case, cfg)
            if outcome is None or outcome[0] != "failed":
                break
        if outcome is not None and outcome[0] == "failed":
            return verdict("failed", outcome[1])
        if outcome is not None and outcome[0] == OUT_OF_MEMORY:
            return memory_verdict(outcome[1], time.perf_counter() - t0)
        ran += 1
        if outcome is not None:
            wrong[m] = outcome[1]
    if ran == 0:
        return verdict("unsupported", refused[0] if refused else "no probe problem accepted")
    if len(wrong) == ran:
        return verdict("incorrect", "; ".join(wrong.values()))
    if wrong:
        return verdict("ok", "wrong at some probe shapes (kept out of the keys whose M bucket holds them): "
                       + "; ".join(wrong.values()), tuple(wrong))
    return verdict("ok")


def memory_verdict(reason: str, seconds: float = 0.0) -> Verdict:
    """The verdict of a probe that ran short of device memory: no verdict on the backend, so a transient failure (this
    process's only, never cached)."""
    return Verdict("failed", f"{OUT_OF_MEMORY} in its probe (not cached: probed again by the next process): {reason}",
                   round(seconds, 4), transient=True)


def _compile_ahead(backend: Backend, device: torch.device, seed: int, upcoming: tuple = ()) -> None:
    """The kernels of the first config at every probe M, compiled at once before the probe runs them one M after
    another (``precompile.compile_together``): a Triton backend's (``compiles_ahead``) on Triton's async-compile
    pool, a first-run library's (``compiles_on_first_run``) by one run per ``first_run_unit`` in threads, the units
    of the ``upcoming`` problems with them. Anything that fails here fails again in the probe, which reports it."""
    ahead, first_run = getattr(backend, "compiles_ahead", False), getattr(backend, "compiles_on_first_run", False)
    if not (ahead or first_run) or device.type != "cuda":
        return
    problems = [probe_problem(backend, m, device) for m in PROBE_MS]
    jobs = []
    for problem in problems if ahead else ():
        try:
            configs = [] if backend.unsupported(problem) else backend.configs(problem)
        except Exception as e:  # noqa: BLE001
            log.debug("probe compile ahead %s at M=%d: %s", backend.name, problem.m, describe_exception(e))
            continue
        if configs:
            jobs.append((problem, lambda p=problem: scratch_ops(p, seed), [(backend, configs[0])]))
    first = [(p, lambda p=p: scratch_ops(p, seed), (backend, cfg))
             for p, cfg in (first_run_jobs(backend, problems + list(upcoming)) if first_run else ())]
    if not (jobs or first):
        return
    try:
        compile_together(jobs, first)
    finally:
        reset_cuda_error(device)
