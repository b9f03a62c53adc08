"""``loop:fp4_mm``: ``fp4_grouped_mm`` as one dense ``fp4_mm`` per expert with rows, each decided by a dispatcher of
the dense backends like any other call: correct wherever ``fp4_mm`` is, and the baseline the grouped kernels must
beat. That dispatcher is the loop's own (made on first use, its cache in ``expert-loop/`` under the cache directory,
its keys verified in priority order without timing):
the dispatcher that runs the loop may be the default one, still probing its backends, the loop among them, so
calling back into it would recurse.

It reads ``offs`` on the host (a sync per call), clamped to [0, T] and non-decreasing as the kernels read it, so it
cannot run inside CUDA graph capture: there it raises, and the dispatcher times it eagerly instead. Each expert's
activation scales are a 128-row-aligned block of the swizzled grouped layout, i.e. a dense swizzled scale tensor of
their own, so no data moves.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..errors import BackendError
from ..format_grouped import scale_starts
from ..problem import M_BUCKETS, GroupedOperands, Problem, m_bucket
from .base import BaseBackend, Config

__all__ = ["ExpertLoopBackend"]


class ExpertLoopBackend(BaseBackend):
    """A Python loop over the experts with rows, one ``fp4_mm`` each."""

    name = "loop:fp4_mm"
    risky = False
    ops = ("grouped",)

    def __init__(self, dispatcher=None):
        self._dense = dispatcher  # what decides each expert's fp4_mm (default: made on first use)
        self._root: Path | None = None  # the cache directory of the dispatcher that holds it

    def set_cache_root(self, root: Path) -> None:
        """The directory under which its own dispatcher keeps its cache (``expert-loop/``): the one of the
        dispatcher that holds this backend (``Dispatcher`` calls it), so that ``--cache-dir`` and ``cache_dir=``
        reach it too."""
        self._root = Path(root)

    def dense(self):
        if self._dense is None:
            from ..dispatch.dispatcher import Dispatcher
            from . import default_backends
            from .base import computes

            from ..settings import default_cache_dir, read_settings

            # a cache directory of its own: its decisions (the probe's shapes among them) stay out of the user's
            # cache, where ``tune`` would report them as decided by nobody. Its keys are verified, not timed
            # (priority order, as FP4DISPATCH_TUNE=0): timing every expert's shape made the loop's device probe
            # alone take half a minute, for a baseline that the grouped kernels beat. A library that compiles on
            # its first run (Humming) is left out: verifying every candidate of each new inner M bucket would
            # compile its kernels for that bucket, and probing it spawn a worker, just to keep a fallback that
            # priority order puts behind fp4dispatch's own kernels, unless FP4DISPATCH_BACKEND names it. A forced
            # backend that is not among its own (another op's) is not forced here: each expert's fp4_mm would refuse it
            settings = read_settings()
            root = self._root or settings.cache_dir or default_cache_dir()
            forced = settings.forced_backend
            own = [b for b in default_backends() if computes(b, "fp4_mm")
                   and (not getattr(b, "compiles_on_first_run", False) or b.name == forced)]
            forced = forced if any(b.name == forced for b in own) else None
            self._dense = Dispatcher(own, cache_dir=Path(root) / "expert-loop",
                                     settings=replace(settings, tune=False, forced_backend=forced))
        return self._dense

    def inner_problems(self, problem: Problem) -> list[tuple[Problem, list]]:
        """The dense problems this loop may call on ``problem`` (an expert holds 1 to T rows: one per M bucket up to
        T's), each with the backends that may decide it (its dispatcher's, less the disabled ones): what
        ``precompile`` compiles ahead, beside the other candidates' kernels, instead of one by one in the checks."""
        d = self.dense()
        backends = [b for b in d.backends if b.name not in d.settings.disabled]
        dense = problem._replace(experts=0)
        return [(dense.with_m(m), backends) for m in M_BUCKETS if m <= m_bucket(problem.m)]

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        if ops.a.is_cuda and torch.cuda.is_current_stream_capturing():
            raise BackendError("loop:fp4_mm reads offs on the host, which CUDA graph capture forbids")
        d = self.dense()
        # offs clamped to [0, T] and made non-decreasing, as the grouped kernels do (docs/contract.md): a table the
        # host did not check (check_offs=False) gives an undefined result, never a fault charged to this backend
        clamped = ops.offs.long().clamp(0, problem.m).cummax(0).values
        bounds = torch.cat((clamped, scale_starts(clamped))).tolist()  # one copy to the host
        ends, starts = bounds[:len(clamped)], bounds[len(clamped):]
        single = ops.alpha.numel() == 1
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                rows = -(-(end - start) // 128) * 128
                sa = ops.a_scale[starts[e]:starts[e] + rows]
                alpha = ops.alpha if single else ops.alpha[e:e + 1]
                d.fp4_mm(ops.a[start:end], ops.b[e], sa, ops.b_scale[e], alpha, out_dtype=problem.out_dtype,
                         out=ops.out[start:end])
            start = end
