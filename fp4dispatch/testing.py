"""Helpers for tests — fp4dispatch's own and users': random NVFP4 inputs, fake backends, a fake timer."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

import torch

from .backends.base import BaseBackend, Config
from .backends.reference import reference_mm
from .format import swizzle_scales
from .problem import Operands, Problem

__all__ = ["make_nvfp4_inputs", "FakeBackend", "fake_do_bench", "make_operands"]


def make_nvfp4_inputs(m: int, n: int, k: int, *, device="cpu", seed: int = 0):
    """Random NVFP4 operands ``(a, b, a_scale, b_scale, alpha)`` for fp4_mm: codes of both signs, positive e4m3
    scales in [2^-3, 2^3] (swizzled, zero-padded), alpha a float32 [1] tensor. Never zeros."""
    if k % 16:
        raise ValueError(f"make_nvfp4_inputs: K must be a multiple of 16; got {k}")
    dev = torch.device(device)
    # generate where the data will live: large weights made on the CPU and copied cost seconds when tuning
    g = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g, device=dev)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g, device=dev)

    def scales(rows: int) -> torch.Tensor:
        exps = torch.randint(-3, 4, (rows, k // 16), generator=g, device=dev).float()
        mant = 1 + torch.randint(0, 8, (rows, k // 16), generator=g, device=dev).float() / 8
        return swizzle_scales((mant * torch.exp2(exps)).to(torch.float8_e4m3fn))

    sa, sb = scales(m), scales(n)
    alpha = 0.5 + torch.rand(1, generator=g, device=dev, dtype=torch.float32)
    return a, b, sa, sb, alpha


def make_operands(problem: Problem, seed: int = 0) -> Operands:
    """Canonical random operands for ``problem`` with a NaN-filled out."""
    a, b, sa, sb, alpha = make_nvfp4_inputs(problem.m, problem.n, problem.k, device=problem.device, seed=seed)
    out = torch.full((problem.m, problem.n), float("nan"), dtype=problem.out_dtype, device=problem.device)
    return Operands(a, b, sa, sb, alpha, out)


_cost_acc = threading.local()


def _charge(seconds: float) -> None:
    _cost_acc.total = getattr(_cost_acc, "total", 0.0) + seconds


def fake_do_bench(fn: Callable[[], object]) -> float:
    """Run ``fn`` once and return, in milliseconds (like ``triton.testing.do_bench``), the summed ``cost`` of the
    fake backends it ran. Lets tuning be tested without a GPU or a clock."""
    _cost_acc.total = 0.0
    fn()
    return _cost_acc.total * 1e3


class FakeBackend(BaseBackend):
    """A scriptable backend. It computes with the exact reference, then misbehaves as asked.

    Args:
        cost: seconds per run as seen by :func:`fake_do_bench`; a float or ``callable(M, N, K) -> float``.
        result: "correct", "zeros", "nan" (NaN rows), "transposed" (b's layout misread), "scaled" (x2).
        unavailable / unsupported: a reason string (the backend says it cannot run on the device / the problem).
        raises: an exception raised by every run.
        wrong_for_m: M values at which it returns zeros.
        nan_rows_for_m: M values at which it writes NaN into its first rows.
        fail_after: runs raise RuntimeError after this many successful runs.
        crash: "exit" (os._exit(3)), "segv" (SIGSEGV to itself) or "hang" (sleeps forever) on every run.
        risky: probe it in a worker process when isolation is on.
    ``.calls`` counts every run (probe, tuning, verification, real calls).
    """

    def __init__(self, name: str, *, cost=1e-5, result: str = "correct", unavailable: str | None = None,
                 unsupported: str | None = None, raises: BaseException | None = None, wrong_for_m=(),
                 nan_rows_for_m=(), fail_after: int | None = None, crash: str | None = None, risky: bool = False,
                 configs: list[Config] | None = None):
        if result not in ("correct", "zeros", "nan", "transposed", "scaled"):
            raise ValueError(f"FakeBackend: unknown result {result!r}")
        self.name = name
        self.cost = cost
        self.result = result
        self._unavailable = unavailable
        self._unsupported = unsupported
        self.raises = raises
        self.wrong_for_m = tuple(wrong_for_m)
        self.nan_rows_for_m = tuple(nan_rows_for_m)
        self.fail_after = fail_after
        self.crash = crash
        self.risky = risky
        self._configs = configs or [{}]
        self.calls = 0
        self.successes = 0

    def unavailable(self, device: torch.device) -> str | None:
        return self._unavailable

    def unsupported(self, problem: Problem) -> str | None:
        return self._unsupported

    def configs(self, problem: Problem) -> list[Config]:
        return list(self._configs)

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        self.calls += 1
        if self.crash == "exit":
            os._exit(3)
        if self.crash == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.crash == "hang":
            while True:
                time.sleep(3600)
        if self.raises is not None:
            raise self.raises
        if self.fail_after is not None and self.successes >= self.fail_after:
            raise RuntimeError(f"{self.name}: failing after {self.fail_after} runs (scripted)")
        self.successes += 1
        c = self.cost(problem.m, problem.n, problem.k) if callable(self.cost) else self.cost
        c = c * config.get("cost_factor", 1.0)
        _charge(c)
        if problem.m in self.wrong_for_m or self.result == "zeros":
            ops.out.zero_()
            return
        if self.result == "transposed":
            k2 = problem.k // 2
            bt = ops.b.reshape(-1)[: problem.n * k2].view(k2, problem.n).t().contiguous()
            ops.out.copy_(reference_mm(problem, ops._replace(b=bt)))
            return
        ref = reference_mm(problem, ops)
        if self.result == "scaled":
            ref = ref * 2
        ops.out.copy_(ref)
        if self.result == "nan" or problem.m in self.nan_rows_for_m:
            ops.out[: max(1, problem.m // 4)] = float("nan")

    def __getstate__(self):
        d = dict(self.__dict__)
        if callable(d.get("cost")) and not isinstance(d["cost"], float):
            d["cost"] = 1e-5  # lambdas do not pickle; a worker process only needs the result behaviour
        return d
