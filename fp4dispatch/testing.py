"""Helpers for tests — fp4dispatch's own and users': random NVFP4 inputs, fake backends, a fake timer."""
from __future__ import annotations

import numbers
import os
import signal
import threading
import time
from typing import Callable

import torch

from .backends.base import OPS, BaseBackend, Config
from .backends.reference import reference_mm
from .devices import resolve_device
from .errors import InvalidInputError
from .format_grouped import swizzle_grouped_scales, unswizzle_grouped_scales
from .problem import Operands, Problem
from .dispatch.verify import random_operands

__all__ = ["make_nvfp4_inputs", "FakeBackend", "fake_do_bench", "make_operands"]


def make_nvfp4_inputs(m: int, n: int, k: int, *, device="cpu", seed: int = 0):
    """Random NVFP4 operands ``(a, b, a_scale, b_scale, alpha)`` for fp4_mm: codes of both signs, positive e4m3
    scales in [2^-3, 2^3] (swizzled, zero-padded), alpha a float32 [1] tensor. Never zeros.
    InvalidInputError when M, N, K are not ints >= 0 with K % 16 == 0, the device cannot hold data here, or the seed
    is not an int that torch.manual_seed takes."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise InvalidInputError(f"make_nvfp4_inputs: {name} must be an int >= 0 (the {name.upper()} of the "
                                    f"M x K by N x K product); got {v!r}. Pass e.g. make_nvfp4_inputs(4, 64, 128)")
    if k % 16:
        raise InvalidInputError(f"make_nvfp4_inputs: k must be a multiple of 16 (one e4m3 scale per 16 values); got "
                                f"{k}. Pass k={-(-k // 16) * 16}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= seed < 2**64:
        raise InvalidInputError(f"make_nvfp4_inputs: seed must be an int in [-2**63, 2**64) (torch.manual_seed's "
                                f"range); got {seed!r}. Pass e.g. seed=0")
    return random_operands(int(m), int(n), int(k), resolve_device(device, "make_nvfp4_inputs"), int(seed))


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


RESULTS = ("correct", "zeros", "nan", "transposed", "scaled", "abs_alpha", "nan_scale_as_zero", "one_expert")
_INPUT_NAMES = (*Operands._fields[:5], "offs")
OUT_FAULTS = ("resize", "past_end", "transposed_strides")
CRASHES = ("exit", "segv", "hang")


class FakeBackend(BaseBackend):
    """A scriptable backend. It computes with the exact reference, then misbehaves as asked.

    Args:
        cost: seconds per run as seen by :func:`fake_do_bench`; a float or ``callable(M, N, K) -> float``.
        result: "correct", "zeros", "nan" (NaN rows), "transposed" (b's layout misread), "scaled" (x2),
            "abs_alpha" (uses |alpha|), "nan_scale_as_zero" (reads a NaN block scale as 0), "one_expert" (a grouped
            call computed as if every row belonged to the first expert: offs ignored).
        unavailable / unsupported: a reason string (the backend says it cannot run on the device / the problem).
        raises: an exception raised by every run.
        wrong_for_m: M values at which it returns zeros.
        nan_rows_for_m: M values at which it writes NaN into its first rows.
        nan_rows_after: once it has run more than this many times, it writes NaN rows (a backend that goes bad
            while serving; may be set on the object at any time).
        fail_after: runs raise RuntimeError after this many successful runs.
        mutates: the name of an input ("a", "b", "a_scale", "b_scale", "alpha"; "offs" of a grouped call) it zeroes
            after computing right.
        out_fault: "resize" (``out.set_`` to [M, N+1]), "past_end" (also writes the row after out, where the
            storage has one) or "transposed_strides" (right values, out left with strides (1, M)).
        crash: "exit" (os._exit(3)), "segv" (SIGSEGV to itself) or "hang" (sleeps forever) on every run.
        risky: probe it in a worker process when isolation is on.
        ops: the ops it computes (default ``("fp4_mm",)``; ``"w4a16"``: ``w4a16_mm``).
    ``.calls`` counts every run (probe, tuning, verification, real calls).
    """

    def __init__(self, name: str, *, cost=1e-5, result: str = "correct", unavailable: str | None = None,
                 unsupported: str | None = None, raises: BaseException | None = None, wrong_for_m=(),
                 nan_rows_for_m=(), nan_rows_after: int | None = None, fail_after: int | None = None,
                 mutates: str | None = None, out_fault: str | None = None, crash: str | None = None,
                 risky: bool = False, configs: list[Config] | None = None, ops: tuple = ("fp4_mm",)):
        if result not in RESULTS:
            raise ValueError(f"FakeBackend: result must be one of {RESULTS}; got {result!r}")
        if out_fault not in (None, *OUT_FAULTS):
            raise ValueError(f"FakeBackend: out_fault must be one of {OUT_FAULTS}; got {out_fault!r}")
        if mutates not in (None, *_INPUT_NAMES):
            raise ValueError(f"FakeBackend: mutates must name an input {_INPUT_NAMES}; got {mutates!r}")
        if crash not in (None, *CRASHES):
            raise InvalidInputError(f"FakeBackend: crash must be None or one of {CRASHES}; got {crash!r}")
        if isinstance(ops, str) or not ops or any(op not in OPS for op in ops):
            raise InvalidInputError(f"FakeBackend: ops must be a tuple of op names from {OPS}; got {ops!r}. Pass e.g. "
                                    "ops=('w4a16',)")
        self.name = name
        self.cost = cost
        self.result = result
        self._unavailable = unavailable
        self._unsupported = unsupported
        self.raises = raises
        self.wrong_for_m = tuple(wrong_for_m)
        self.nan_rows_for_m = tuple(nan_rows_for_m)
        self.nan_rows_after = nan_rows_after
        self.fail_after = fail_after
        self.mutates = mutates
        self.out_fault = out_fault
        self.crash = crash
        self.risky = risky
        self.ops = tuple(ops)
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
        _charge(c * config.get("cost_factor", 1.0))
        if problem.m in self.wrong_for_m or self.result == "zeros":
            ops.out.zero_()
            return
        ops.out.copy_(self._compute(problem, ops))
        if (self.result == "nan" or problem.m in self.nan_rows_for_m
                or (self.nan_rows_after is not None and self.calls > self.nan_rows_after)):
            ops.out[: max(1, problem.m // 4)] = float("nan")
        if self.mutates:
            getattr(ops, self.mutates).view(torch.uint8).zero_()
        if self.out_fault:
            self._break_out(problem, ops)

    def _compute(self, problem: Problem, ops: Operands) -> torch.Tensor:
        if self.result == "transposed":
            k2 = problem.k // 2
            bt = ops.b.reshape(-1)[: problem.n * k2].view(k2, problem.n).t().contiguous()
            return reference_mm(problem, ops._replace(b=bt))
        if self.result == "one_expert":
            offs = torch.full_like(ops.offs, problem.m)
            sa = swizzle_grouped_scales(unswizzle_grouped_scales(ops.a_scale, ops.offs, problem.m, problem.k // 16),
                                        offs, ops.a_scale.shape[0])
            return reference_mm(problem, ops._replace(offs=offs, a_scale=sa))
        if self.result == "abs_alpha":
            return reference_mm(problem, ops._replace(alpha=ops.alpha.abs()))
        if self.result == "nan_scale_as_zero":
            return reference_mm(problem, ops._replace(a_scale=_nan_as_zero(ops.a_scale),
                                                      b_scale=_nan_as_zero(ops.b_scale)))
        ref = reference_mm(problem, ops)
        return ref * 2 if self.result == "scaled" else ref

    def _break_out(self, problem: Problem, ops: Operands) -> None:
        m, n = problem.m, problem.n
        out = ops.out
        if self.out_fault == "resize":
            out.set_(torch.zeros(m, n + 1, dtype=out.dtype, device=out.device))
        elif self.out_fault == "transposed_strides":
            out.set_(out.t().clone(memory_format=torch.contiguous_format).t())
        elif out.untyped_storage().nbytes() >= (out.storage_offset() + (m + 1) * n) * out.element_size():
            torch.as_strided(out, (m + 1, n), (n, 1))[m] = out[m - 1]

    def __getstate__(self):
        d = dict(self.__dict__)
        if callable(d.get("cost")) and not isinstance(d["cost"], float):
            d["cost"] = 1e-5  # lambdas do not pickle; a worker process only needs the result behaviour
        return d


def _nan_as_zero(s: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(s.float(), nan=0.0).to(torch.float8_e4m3fn)
