"""Dispatch overhead on the CPU: a call through a warmed dispatcher vs the chosen backend's ``run`` called directly
on canonical operands, interleaved in the same run, tiny shapes. Last line: ``overhead_us=<median>``.

The backend is a memoizing wrapper around the exact reference (it recomputes on new inputs, so it passes the
dispatcher's probe and verification, and otherwise copies the remembered result): its run costs ~1 us, so the
difference measures the dispatcher, not the noise of a slow kernel. ``--op`` picks the call: ``fp4_mm`` (default),
``w4a16`` (``w4a16_mm``, bf16 activations), ``grouped`` (``fp4_grouped_mm`` over 4 experts with
``check_offs=False``, as ``Fp4MoeExperts`` calls it).

    python benchmarks/bench_overhead.py [--reps 20000] [--op fp4_mm|w4a16|grouped]
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
from fp4dispatch.format_grouped import grouped_scale_rows
from fp4dispatch.problem import GroupedOperands, Operands, Problem
from fp4dispatch.testing import make_nvfp4_inputs

SHAPES = [(1, 32, 32), (4, 64, 64), (16, 128, 128)]
EXPERTS = 4


class MemoReference(BaseBackend):
    name = "memo-reference"
    ops = ("fp4_mm", "w4a16", "grouped")

    def __init__(self):
        self._memo = {}

    def run(self, problem, ops, config):
        key = (ops.a.data_ptr(), ops.b.data_ptr(), ops.a._version, ops.b._version, problem)
        r = self._memo.get(key)
        if r is None:
            r = self._memo[key] = reference_mm(problem, ops).to(problem.out_dtype)
        ops.out.copy_(r)


def _call(d: Dispatcher, op: str, m: int, n: int, k: int):
    """(the dispatcher call, its problem, its canonical operands) for ``op`` at this shape."""
    a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if op == "fp4_mm":
        return (lambda: d.fp4_mm(a, b, sa, sb, alpha, out=out), Problem(m, n, k, torch.bfloat16, torch.device("cpu")),
                Operands(a, b, sa, sb, alpha, out))
    if op == "w4a16":
        x = torch.randn(m, k, dtype=torch.bfloat16)
        problem = Problem(m, n, k, torch.bfloat16, torch.device("cpu"), torch.bfloat16)
        return (lambda: d.w4a16_mm(x, b, sb, alpha, out=out), problem,
                Operands(x, b, torch.empty(0, dtype=torch.float8_e4m3fn), sb, alpha, out))
    # grouped: m rows over EXPERTS experts of the same weight, a_scale with room for any routing (check_offs=False)
    be, sbe = b.expand(EXPERTS, -1, -1).contiguous(), sb.expand(EXPERTS, -1, -1).contiguous()
    offs = torch.tensor([m * (e + 1) // EXPERTS for e in range(EXPERTS)], dtype=torch.int32)
    sae = torch.zeros(grouped_scale_rows(m, EXPERTS), sa.shape[1], dtype=sa.dtype)
    al = alpha.expand(EXPERTS).contiguous()
    problem = Problem(m, n, k, torch.bfloat16, torch.device("cpu"), torch.uint8, EXPERTS)
    return (lambda: d.fp4_grouped_mm(a, be, sae, sbe, al, offs, out=out, check_offs=False), problem,
            GroupedOperands(a, be, sae, sbe, al, out, offs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--op", choices=("fp4_mm", "w4a16", "grouped"), default="fp4_mm")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = Dispatcher([MemoReference()], cache_dir=tempfile.mkdtemp(prefix="fp4bench-"))
    extra = []
    print(f"{'M,N,K':>12} {'direct us':>10} {args.op + ' us':>12} {'extra us':>9}")
    for m, n, k in SHAPES:
        call, problem, ops = _call(d, args.op, m, n, k)
        call()  # decide the key (probe + tune) before timing
        choice = d.choose(problem)
        run = choice.backend.run
        direct, full = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter_ns()
            run(problem, ops, choice.config)
            t1 = time.perf_counter_ns()
            call()
            t2 = time.perf_counter_ns()
            direct.append(t1 - t0)
            full.append(t2 - t1)
        md, mf = statistics.median(direct) / 1e3, statistics.median(full) / 1e3
        extra.append(mf - md)
        print(f"{f'{m},{n},{k}':>12} {md:10.2f} {mf:12.2f} {mf - md:9.2f}")
    print(f"overhead_us={statistics.median(extra):.2f}")


if __name__ == "__main__":
    main()
