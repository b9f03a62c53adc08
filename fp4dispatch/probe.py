"""Probe: does a backend run on this device, and is it right? A verdict is data, never an exception.

Statuses: ``ok``, ``unavailable`` (cannot run here: library missing, SM refused), ``unsupported`` (runs here but
refused every probe problem), ``failed`` (raised, crashed or hung), ``incorrect`` (wrong at every probe M).
A backend wrong at only some probe M stays ``ok`` for the device, with a note; per-shape verification at tuning
time keeps it out of exactly the keys where it is wrong.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .backends.base import Backend
from .backends.reference import reference_mm
from .problem import Problem
from .testing import make_operands
from .verify import PROBE_K, PROBE_MS, PROBE_N, check_output, poison

__all__ = ["Verdict", "probe_backend", "describe_exception", "reset_cuda_error"]

log = logging.getLogger("fp4dispatch")


@dataclass
class Verdict:
    status: str
    reason: str = ""
    seconds: float = 0.0
    transient: bool = False  # not written to the disk cache (e.g. a probe worker that timed out)

    def to_json(self) -> dict:
        return {"status": self.status, "reason": self.reason, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> "Verdict":
        return cls(str(d.get("status", "failed")), str(d.get("reason", "")), float(d.get("seconds", 0.0)))


def describe_exception(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:300]}" if msg else type(e).__name__


def reset_cuda_error(device: torch.device) -> None:
    """After a failed kernel: synchronize, then clear the sticky error flag (only cudaGetLastError resets it)."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - the error itself is what we are clearing
        pass
    try:
        torch.cuda.cudart().cudaGetLastError()
    except Exception:  # noqa: BLE001
        pass


def probe_backend(backend: Backend, device: torch.device, seed: int = 1234) -> Verdict:
    """Run ``backend`` on the probe problems (fresh random inputs, NaN-poisoned out) against the reference."""
    t0 = time.perf_counter()

    def verdict(status: str, reason: str = "") -> Verdict:
        return Verdict(status, reason, round(time.perf_counter() - t0, 4))

    try:
        why = backend.unavailable(device)
    except Exception as e:  # noqa: BLE001 - a broken availability check is a verdict too
        return verdict("unavailable", f"availability check raised {describe_exception(e)}")
    if why:
        return verdict("unavailable", why)
    wrong: list[str] = []
    refused: list[str] = []
    ran = 0
    for i, m in enumerate(PROBE_MS):
        problem = Problem(m, PROBE_N, PROBE_K, torch.bfloat16, device)
        why = backend.unsupported(problem)
        if why:
            refused.append(why)
            continue
        ops = make_operands(problem, seed=seed + i)
        ref = reference_mm(problem, ops)
        error = None
        # the first config that runs decides; a backend fails only if every config raises
        for cfg in backend.configs(problem):
            poison(ops.out)
            try:
                backend.run(problem, ops, cfg)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                error = None
                break
            except Exception as e:  # noqa: BLE001 - failures are data
                reset_cuda_error(device)
                error = error or e
        if error is not None:
            return verdict("failed", f"{describe_exception(error)} (at M={m})")
        ran += 1
        bad = check_output(ops.out, ref, problem)
        if bad:
            wrong.append(bad)
    if ran == 0:
        return verdict("unsupported", refused[0] if refused else "no probe problem accepted")
    if len(wrong) == ran:
        return verdict("incorrect", "; ".join(wrong))
    if wrong:
        return verdict("ok", "wrong at some probe shapes (kept out of those keys): " + "; ".join(wrong))
    return verdict("ok")
