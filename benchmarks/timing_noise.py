"""How stable are the tuner's timings? Every triton:fused / triton:dequant+matmul config on a few small-M keys,
timed three times with triton.testing.do_bench (the tuner's timer: launch overhead included) and with
do_bench_cudagraph (GPU time only), medians in us.

    python3 benchmarks/timing_noise.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench, do_bench_cudagraph

from fp4dispatch.backends.base import config_id
from fp4dispatch.backends.triton_dequant import TritonDequantBackend
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands


def main() -> None:
    dev = torch.device("cuda", 0)
    for m, n, k in [(1, 4096, 14336), (1, 8192, 8192), (16, 4096, 4096)]:
        p = Problem(m, n, k, torch.bfloat16, dev)
        ops = make_operands(p, seed=1)
        print(f"--- M={m} N={n} K={k}")
        for be in (TritonFusedBackend(), TritonDequantBackend()):
            for cfg in be.configs(p):
                fn = lambda: be.run(p, ops, cfg)  # noqa: E731
                try:
                    fn()
                    torch.cuda.synchronize()
                    eager = [do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3 for _ in range(3)]
                    graph = [do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3 for _ in range(2)]
                except Exception as e:  # noqa: BLE001
                    print(f"  {be.name}[{config_id(cfg)}]: {type(e).__name__}: {str(e)[:120]}")
                    continue
                print(f"  {be.name:22s} eager {' '.join(f'{t:7.1f}' for t in eager)} | graph "
                      f"{' '.join(f'{t:7.1f}' for t in graph)}  [{config_id(cfg)}]")


if __name__ == "__main__":
    main()
