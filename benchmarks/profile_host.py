"""Where the host time of an eager call goes: cProfile over back-to-back ``fused_mm`` and ``fp4_mm`` calls (top
functions by own time), for a one-launch and a two-launch config and the Gluon ``wgws`` (two launches, two TMA
descriptors). ``--ab``: instead, host time per call with the
direct launch of compiled kernels (``kernels/launch.py``) on and off, interleaved in one process (the lent machine's
host speed moves between runs, so only same-run comparisons hold).

    export PYTHONPATH=$PWD; python benchmarks/profile_host.py [--ab]
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
from bench_hopper import rand_operands  # benchmarks/ is on sys.path when this file runs as a script

from fp4dispatch.kernels.fused import fused_mm

CASES = [
    (1, 6144, 2048, {"kernel": "gemv2", "MB": 1, "BN": 4, "BKB": 128, "split": 1, "warps": 2, "stages": 3,
                     "PAIR": True, "prefetch": True, "H2": True, "CVT": True}),
    (16, 8192, 8192, {"kernel": "wmma", "BM": 16, "BN": 64, "BKB": 16, "split": 4, "warps": 4, "stages": 3,
                      "APRE": True}),
    (1024, 6144, 2048, {"kernel": "wgws", "BM": 256, "BN": 128, "BKB": 4, "stages": 5}),  # SM90, Triton 3.6
]


def _host_us(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / reps * 1e6


def main(reps: int = 500) -> None:
    import fp4dispatch

    for m, n, k, cfg in CASES:
        ops = rand_operands(m, n, k, seed=1)
        calls = {"fused_mm": lambda c=cfg: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, c),
                 "fp4_mm": lambda: fp4dispatch.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, out=ops.out)}
        for name, fn in calls.items():
            fn()
            print(f"--- M={m} N={n} K={k} {cfg['kernel']} {name}: {_host_us(fn, reps):.1f} us host per call", flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(reps):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def ab(reps: int = 500, rounds: int = 5) -> None:
    from fp4dispatch.format import quantize_nvfp4
    from fp4dispatch.kernels import launch

    calls = []
    for m, n, k, cfg in CASES:
        ops = rand_operands(m, n, k, seed=1)
        calls.append((f"M={m} N={n} K={k} {cfg['kernel']} fused_mm",
                      lambda o=ops, c=cfg: fused_mm(o.a, o.b, o.a_scale, o.b_scale, o.alpha, o.out, c)))
    # the activation quantize an NVFP4 layer runs before each fp4_mm (Triton kernel on CUDA)
    x = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor([448 * 6 / 4.0], device="cuda")
    calls.append(("M=16 K=8192 quantize_nvfp4", lambda: quantize_nvfp4(x, gs)))
    for name, call in calls:
        call()
        times = {True: [], False: []}
        for _ in range(rounds):
            for fast in (True, False):
                launch._fast = fast
                times[fast].append(_host_us(call, reps))
        launch._fast = True
        med = {f: sorted(t)[len(t) // 2] for f, t in times.items()}
        print(f"{name}: host us per call, median of {rounds} rounds of {reps}: direct launch {med[True]:.1f}, "
              f"kernel[grid] {med[False]:.1f} ({med[False] / med[True]:.2f}x)", flush=True)


if __name__ == "__main__":
    ab() if "--ab" in sys.argv else main()
