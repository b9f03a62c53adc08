"""Dispatch overhead on the CPU: ``fp4_mm`` through a warmed dispatcher vs the chosen backend's ``run`` called
directly on canonical operands, interleaved in the same run, tiny shapes. Last line: ``overhead_us=<median>``.

The backend is a memoizing wrapper around the exact reference (it recomputes on new inputs, so it passes the
dispatcher's probe and verification, and otherwise copies the remembered result): its run costs ~1 us, so the
difference measures the dispatcher, not the noise of a slow kernel.

    python benchmarks/bench_overhead.py [--reps 20000]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from fp4dispatch.backends.base import BaseBackend
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import make_nvfp4_inputs

SHAPES = [(1, 32, 32), (4, 64, 64), (16, 128, 128)]


class MemoReference(BaseBackend):
    name = "memo-reference"

    def __init__(self):
        self._memo = {}

    def run(self, problem, ops, config):
        key = (ops.a.data_ptr(), ops.b.data_ptr(), ops.a._version, ops.b._version, problem)
        r = self._memo.get(key)
        if r is None:
            r = self._memo[key] = reference_mm(problem, ops).to(problem.out_dtype)
        ops.out.copy_(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = Dispatcher([MemoReference()], cache_dir=tempfile.mkdtemp(prefix="fp4bench-"))
    extra = []
    print(f"{'M,N,K':>12} {'direct us':>10} {'fp4_mm us':>10} {'extra us':>9}")
    for m, n, k in SHAPES:
        a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        d.fp4_mm(a, b, sa, sb, alpha, out=out)  # decide the key (probe + tune) before timing
        problem = Problem(m, n, k, torch.bfloat16, torch.device("cpu"))
        choice = d.choose(problem)
        ops = Operands(a, b, sa, sb, alpha, out)
        run, fp4_mm = choice.backend.run, d.fp4_mm
        direct, full = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter_ns()
            run(problem, ops, choice.config)
            t1 = time.perf_counter_ns()
            fp4_mm(a, b, sa, sb, alpha, out=out)
            t2 = time.perf_counter_ns()
            direct.append(t1 - t0)
            full.append(t2 - t1)
        md, mf = statistics.median(direct) / 1e3, statistics.median(full) / 1e3
        extra.append(mf - md)
        print(f"{f'{m},{n},{k}':>12} {md:10.2f} {mf:10.2f} {mf - md:9.2f}")
    print(f"overhead_us={statistics.median(extra):.2f}")


if __name__ == "__main__":
    main()
