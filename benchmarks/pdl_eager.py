"""Eager cost of one ``fused_mm`` call with and without programmatic dependent launch (PDL): ``do_bench`` (L2 flushed
between calls), 300 calls back to back (CUDA events around them, and the host's time per call) and the CUDA-graph
time of the same call.

    export PYTHONPATH=$PWD; python benchmarks/pdl_eager.py
"""
from __future__ import annotations

import time

import torch
from bench_hopper import graph_ms, rand_operands  # benchmarks/ is on sys.path when this file runs as a script
from triton.testing import do_bench

from fp4dispatch.kernels.fused import fused_mm

CASES = [
    (1, 6144, 2048, {"kernel": "gemv2", "MB": 1, "BN": 4, "BKB": 128, "split": 1, "warps": 2, "stages": 3,
                     "PAIR": True, "prefetch": True, "H2": True, "CVT": True}),
    (16, 8192, 8192, {"kernel": "wmma", "BM": 16, "BN": 64, "BKB": 16, "split": 4, "warps": 4, "stages": 3,
                      "APRE": True}),
    (16, 2048, 6144, {"kernel": "wmma", "BM": 16, "BN": 64, "BKB": 16, "split": 4, "warps": 4, "stages": 3}),
]


def main(reps: int = 300) -> None:
    for m, n, k, cfg in CASES:
        ops = rand_operands(m, n, k, seed=1)
        for pdl in (True, False):
            c = dict(cfg, pdl=pdl)

            def call(c=c):
                fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, c)

            call()
            torch.cuda.synchronize()
            t_flush = do_bench(call, warmup=5, rep=25, return_mode="median") * 1e3
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            for _ in range(reps):
                call()
            e1.record()
            host = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            print(f"M={m} N={n} K={k} {cfg['kernel']} pdl={pdl}: eager do_bench {t_flush:.1f} us, back-to-back "
                  f"{e0.elapsed_time(e1) / reps * 1e3:.1f}, cpu/call {host:.1f} us, graph {graph_ms(call) * 1e3:.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
