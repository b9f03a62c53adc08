"""Autotune one key: verify every candidate (backend x config) on that shape, time the correct ones.

A candidate that raises or is wrong scores ``inf`` with its reason; failures are data (Triton's ``_bench``). The
inputs are the hostile check inputs of :mod:`fp4dispatch.dispatch.verify`, so a candidate is timed only once it has been
proven right on them.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..backends.base import Backend, Config, config_id, config_json
from ..backends.reference import reference_mm
from .timer import DoBench
from ..errors import describe_exception
from ..problem import Problem
from ..routing import timing_routing
from .verify import CheckCase, check_run, make_case, reset_cuda_error

__all__ = ["Trial", "tune", "verify_only", "check_trial"]

log = logging.getLogger("fp4dispatch")


@dataclass
class Trial:
    backend: str
    config: Config = field(default_factory=dict)
    time_ms: float = math.inf
    reason: str = ""  # empty when the trial is correct and timed
    # wall seconds of its check, its first run on this shape: a JIT compile or a weight preparation shows here
    check_s: float | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.time_ms)

    def to_json(self) -> dict:
        d = {"backend": self.backend, "config": config_json(self.config),
             "time_us": round(self.time_ms * 1e3, 3) if self.ok else None, "reason": self.reason}
        return d if self.check_s is None else {**d, "check_s": round(self.check_s, 3)}


def check_trial(backend: Backend, case: CheckCase, cfg: Config) -> str:
    """"" when ``backend`` with ``cfg`` computes ``case`` right, else ``"failed: ..."`` / ``"incorrect: ..."``."""
    outcome = check_run(backend, case, cfg)
    return f"{outcome[0]}: {outcome[1]}" if outcome else ""


def _configs(backend: Backend, problem: Problem) -> tuple[list, str]:
    """(configs, "") or ([], reason): a backend that cannot list a config is a failed candidate, not a crash."""
    try:
        cfgs = list(backend.configs(problem))
    except Exception as e:  # noqa: BLE001
        return [], f"failed: configs() raised {describe_exception(e)}"
    return cfgs, "" if cfgs else "failed: configs() offered none"


def tune(problem: Problem, candidates: list[Backend], do_bench: DoBench, seed: int = 7) -> list[Trial]:
    """Every candidate x config, fastest correct first; failed/incorrect trials last with their reasons."""
    case = make_case(problem, seed, reference_mm)
    # checked on the hostile case; timed on the same operands, but a grouped key on a realistic routing (the check's
    # may put every row on one expert, a dense GEMM on one L2-resident weight: not what a MoE layer runs). The
    # swizzled activation scales hold any routing of T rows, so only offs changes.
    timed = case.ops if not problem.experts else case.ops._replace(
        offs=timing_routing(problem.m, problem.experts, seed, problem.device))
    trials: list[Trial] = []
    for backend in candidates:
        cfgs, why = _configs(backend, problem)
        if why:
            trials.append(Trial(backend.name, {}, reason=why))
        for cfg in cfgs:
            t = Trial(backend.name, cfg)
            t0 = time.perf_counter()
            t.reason = check_trial(backend, case, cfg)
            t.check_s = time.perf_counter() - t0
            if not t.reason:
                try:
                    t.time_ms = float(do_bench(lambda b=backend, c=cfg: b.run(problem, timed, c)))
                except Exception as e:  # noqa: BLE001
                    reset_cuda_error(problem.device)
                    t.reason = f"failed while timing: {describe_exception(e)}"
                if not math.isfinite(t.time_ms) and not t.reason:
                    t.reason = "timer returned a non-finite time"
                    t.time_ms = math.inf
            log.debug("tune %s: %s[%s] -> %s", problem, backend.name, config_id(cfg), t.to_json())
            trials.append(t)
    trials.sort(key=lambda t: t.time_ms)
    return trials


def verify_only(problem: Problem, candidates: list[Backend], seed: int = 7) -> list[Trial]:
    """Priority order, no timing (``FP4DISPATCH_TUNE=0``, and the CPU, where load would decide): the first config
    of each backend is verified; its rank stands in for a time so that the order survives sorting and the cache."""
    case = make_case(problem, seed, reference_mm)
    trials = []
    for rank, backend in enumerate(candidates):
        cfgs, why = _configs(backend, problem)
        cfg = cfgs[0] if cfgs else {}
        reason = why or check_trial(backend, case, cfg)
        trials.append(Trial(backend.name, cfg, math.inf if reason else float(rank), reason))
    trials.sort(key=lambda t: t.time_ms)
    return trials
