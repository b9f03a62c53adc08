"""One key's compiles, beside its checks (the tuner's compile phase): each candidate is checked as soon as its own
kernels are compiled, while the others still compile, and a library's first run goes on meanwhile.

``TritonCompiles`` hands the key's Triton compiles out at once (``runtime.compiles_ahead``, as ``precompile`` does) and
then hands the candidates back in the order their compiles end: the first one's check and screen run while the
slowest config still compiles, instead of after it. ``FirstRuns`` runs each first-run library once in a thread of its
own (``precompile``: Humming compiles a new shape's kernels in its first call), on the check case's inputs with an
``out`` of its own, so that the other candidates can be checked and screened on the same case meanwhile.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import torch

from ..backends.base import Backend, Config, config_id
from ..kernels import runtime
from ..problem import Problem
from .precompile import compile_workers, first_run, inner_jobs, on_device, run_pairs, split_pairs
from .verify import CheckCase, reset_cuda_error, restore_inputs

__all__ = ["compile_ahead", "KeyAhead", "TritonCompiles", "FirstRuns"]

Pair = tuple[Backend, Config]


class TritonCompiles:
    """The compiles of ``jobs`` ((problem, scratch operands maker, pairs)), handed out when this is made: each pair
    runs once inside ``runtime.compiles_ahead`` (its kernels that still need compiling go to a thread pool, the rest
    run on the scratch operands). ``in_order`` then yields pairs in the order their compiles end, each once its
    kernels are in Triton's cache; a pair with nothing handed out comes at once. In this thread, a launch of a kernel
    still compiling waits for that compile (``compiles_ahead.launching``): another thread would compile it again.
    ``waited``: the seconds ``in_order`` waited; ``compiled_s``: from the start until its last pair's compiles were
    over (None before; ``close`` waits for the rest and sets it to its own end if still None)."""

    def __init__(self, jobs: list[tuple[Problem, Callable[[], object], list[Pair]]]):
        self.waited, self.compiled_s, self._start = 0.0, None, time.perf_counter()
        self._handed: dict[tuple, list] = {}
        self._ctx = runtime.compiles_ahead(compile_workers() if jobs else 0)
        self._ctx.__enter__()
        try:
            for problem, make_ops, pairs in jobs if self._ctx.active else ():
                with on_device(problem.device):
                    ops = make_ops()
                    for b, cfg in pairs:
                        handed = self._ctx.collect()
                        run_pairs(problem, ops, [(b, cfg)])
                        self._handed.setdefault((problem.key, b.name, config_id(cfg)), []).extend(handed)
            self._ctx.launching()
        except BaseException:
            self.close()
            raise
        finally:
            for dev in {p.device for p, _, _ in jobs}:
                reset_cuda_error(dev)

    def in_order(self, problem: Problem, pairs: list[Pair]) -> Iterator[Pair]:
        """``pairs`` of ``problem``, each as soon as its compiles are over (in list order among those that are)."""
        kernels = [self._handed.get((problem.key, b.name, config_id(c)), []) for b, c in pairs]
        left = list(range(len(pairs)))
        while left:
            i = next((i for i in left if not runtime.pending(kernels[i])), None)
            t = time.perf_counter()
            if i is None:
                wait([f for j in left for f in runtime.pending(kernels[j])], return_when=FIRST_COMPLETED)
            else:
                left.remove(i)
                runtime.finish(kernels[i])  # into Triton's cache (and the post-compile hooks), in this thread
            self.waited += time.perf_counter() - t
            if i is not None:
                yield pairs[i]
        self.compiled_s = time.perf_counter() - self._start

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)
        if self.compiled_s is None:
            self.compiled_s = time.perf_counter() - self._start


class FirstRuns:
    """One key's first runs (``compile_ahead``), each started in a thread of its own when this is made: ``names`` are
    their backends, whose checks must wait for ``wait``. They run on the key's check inputs with an ``out`` of their
    own, so that the key's other candidates can be checked and screened on the same case meanwhile (their CUDA calls
    do not spoil the screen timer's captures: ``timer._graph_replays``). ``wait()`` returns once they are over, a CUDA
    error they left cleared and any input they changed put back (``restore_inputs`` records it in ``case.restored``:
    the outcomes of whatever ran on the case meanwhile then prove nothing); a second call returns at once.
    ``seconds["first_runs"]``, if given: from their start until the last one ended."""

    def __init__(self, case: CheckCase, first: list[Pair], seconds: dict | None = None):
        self.case, self.seconds, self.names = case, seconds, frozenset(b.name for b, _ in first)
        self._start, self._waited = time.perf_counter(), False
        self._pool = ThreadPoolExecutor(len(first), thread_name_prefix="fp4dispatch-first-run") if first else None
        # the case's inputs, an out of their own
        own = case.ops._replace(out=torch.empty_like(case.ops.out)) if first else None
        self._futures = [self._pool.submit(first_run, case.problem, lambda: own, pair) for pair in first]

    def wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        try:
            ends = [f.result() for f in self._futures]
        finally:
            if self._pool is not None:
                self._pool.shutdown()
        if self.seconds is not None:
            self.seconds["first_runs"] = max(ends, default=self._start) - self._start
        if self._futures:
            reset_cuda_error(self.case.problem.device)
            restore_inputs(self.case)


class KeyAhead(NamedTuple):
    """What ``compile_ahead``'s body gets: the key's first runs and its Triton compiles."""

    first_runs: FirstRuns
    triton: TritonCompiles


@contextmanager
def compile_ahead(problem: Problem, case: CheckCase, pairs: list[Pair], seconds: dict | None = None):
    """One key: its Triton configs on copies of the case's operands and the dense configs of its loop
    (``precompile.inner_jobs``) on scratch operands, handed out to compile when the body starts (``TritonCompiles``:
    the loop's first, whose kernels then compile first); its first-run libraries, one run each, running in the body
    (``FirstRuns``). Leaving waits for both. ``seconds`` (if given) gets ``triton`` (``TritonCompiles.compiled_s``)
    and ``first_runs``."""
    ahead, first = split_pairs(pairs)
    jobs = []
    if problem.device.type == "cuda":  # Triton compiles ahead for CUDA only; the interpreter compiles nothing
        ops = case.ops

        def copies():
            return ops._replace(**{f: t.clone() for f, t in zip(ops._fields, ops) if f != "out"},
                                out=case.frame.clone()[1:problem.m + 1])

        jobs = inner_jobs(dict.fromkeys(b for b, _ in pairs), problem) + ([(problem, copies, ahead)] if ahead else [])
    runs = FirstRuns(case, first, seconds)
    triton = None
    try:
        triton = TritonCompiles(jobs)
        yield KeyAhead(runs, triton)
    finally:
        if triton is not None:
            triton.close()
            if seconds is not None:
                seconds["triton"] = triton.compiled_s
        runs.wait()
