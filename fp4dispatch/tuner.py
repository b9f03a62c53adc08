"""Autotune one key: verify every candidate (backend x config) on that shape, time the correct ones.

A candidate that raises or is wrong scores ``inf`` with its reason; failures are data (Triton's ``_bench``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from .backends.base import Backend, Config, config_id, config_json
from .backends.reference import reference_mm
from .bench import DoBench
from .probe import describe_exception, reset_cuda_error
from .problem import Problem
from .testing import make_operands
from .verify import check_output, poison

__all__ = ["Trial", "tune", "verify_only"]

log = logging.getLogger("fp4dispatch")


@dataclass
class Trial:
    backend: str
    config: Config = field(default_factory=dict)
    time_ms: float = math.inf
    reason: str = ""  # empty when the trial is correct and timed

    @property
    def ok(self) -> bool:
        return math.isfinite(self.time_ms)

    def to_json(self) -> dict:
        return {"backend": self.backend, "config": config_json(self.config),
                "time_us": round(self.time_ms * 1e3, 3) if self.ok else None, "reason": self.reason}


def _verify(backend: Backend, problem: Problem, ops, ref, cfg: Config) -> str | None:
    poison(ops.out)
    try:
        backend.run(problem, ops, cfg)
        if problem.device.type == "cuda":
            torch.cuda.synchronize(problem.device)
    except Exception as e:  # noqa: BLE001
        reset_cuda_error(problem.device)
        return f"failed: {describe_exception(e)}"
    bad = check_output(ops.out, ref, problem)
    return f"incorrect: {bad}" if bad else None


def tune(problem: Problem, candidates: list[Backend], do_bench: DoBench, seed: int = 7) -> list[Trial]:
    """Every candidate x config, fastest correct first; failed/incorrect trials last with their reasons."""
    ops = make_operands(problem, seed=seed)
    ref = reference_mm(problem, ops)
    trials: list[Trial] = []
    for backend in candidates:
        for cfg in backend.configs(problem):
            t = Trial(backend.name, cfg)
            t.reason = _verify(backend, problem, ops, ref, cfg) or ""
            if not t.reason:
                try:
                    t.time_ms = float(do_bench(lambda b=backend, c=cfg: b.run(problem, ops, c)))
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
    """``FP4DISPATCH_TUNE=0``: keep priority order, verify each backend's first config, time nothing."""
    ops = make_operands(problem, seed=seed)
    ref = reference_mm(problem, ops)
    trials = []
    for rank, backend in enumerate(candidates):
        cfg = backend.configs(problem)[0]
        reason = _verify(backend, problem, ops, ref, cfg)
        # the rank stands in for a time so that the order survives sorting and the cache
        trials.append(Trial(backend.name, cfg, math.inf if reason else float(rank), reason or ""))
    trials.sort(key=lambda t: t.time_ms)
    return trials
