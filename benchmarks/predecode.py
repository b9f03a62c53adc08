"""The pre-decode kernel (``fused.predecode``: one operand's NVFP4 words to fp16 once per call, before ``wgws``,
``wgds`` and ``wmma`` with APRE) by CTA tile (issue 8, fifteenth session).

ncu (benchmarks/RESULTS.md, fifteenth session run 8) measured it at 4.0-7.8 us per call at M = 1024-8192, serial with
the GEMM that follows, at 0.3-0.6 TB/s of DRAM traffic: one small CTA (16 rows x 16 blocks, 4 warps, 32 values a
thread) per 256 values of a row. This times other CTA tiles on the same inputs and checks that each writes the same
bits as the library's.

    python3 benchmarks/predecode.py [--tiles "16,16,4;32,16,4"] [--e2e]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hopper import graph_ms, rand_operands  # noqa: E402

from fp4dispatch.kernels.fused import predecode  # noqa: E402

TILES = ((16, 16, 4), (32, 16, 4), (64, 16, 8), (16, 32, 4), (32, 32, 4), (64, 16, 4), (128, 16, 8))
# (rows, K) pre-decoded per call: the activation at M = 128 / 1024 / 4096 / 8192, the weight of a swapped 768x6144
ROWS_K = ((128, 8192), (1024, 2048), (1024, 6144), (1024, 8192), (768, 6144), (4096, 6144), (8192, 8192), (3, 1040),
          (130, 1152), (300, 2080))  # the last three: rows and K that no tile divides (bits only)


def main(tiles=TILES) -> None:
    for rows, k in ROWS_K:
        ops = rand_operands(rows, 32, k, seed=rows)
        args = (ops.a.view(torch.int64), ops.a_scale.view(torch.uint8), True)
        run = {t: (lambda t=t: predecode(*args, t, CVT=True)) for t in tiles}
        want = run[tiles[0]]()
        same = {t: torch.equal(run[t]().view(torch.int16), want.view(torch.int16)) for t in tiles}
        res = sorted((graph_ms(run[t]) * 1e3, t) for t in tiles)
        print(f"rows={rows} K={k} ({rows * k * 2 / 1e6:.1f} MB fp16 out) us: " +
              ", ".join(f"{'x'.join(map(str, t))} {us:.2f}{'' if same[t] else ' DIFFERENT BITS'}" for us, t in res),
              flush=True)


PICKS = ((6144, 2048, 1024, {"kernel": "wgws", "BM": 256, "BN": 64, "BKB": 8, "stages": 3}),
         (2048, 6144, 1024, {"kernel": "wgws", "BM": 256, "BN": 64, "BKB": 8, "stages": 3}),
         (768, 6144, 4096, {"kernel": "wgws", "BM": 256, "BN": 128, "BKB": 4, "stages": 5, "swap": True}),
         (8192, 8192, 128, {"kernel": "wgds", "BM": 128, "BN": 64, "BKB": 8, "stages": 4, "astages": 4, "dstages": 3,
                            "parts": 2}))


def e2e(tiles=TILES) -> None:
    """The table's picks at M = 1024 / 4096 (and wgds at M = 128) with each pre-decode tile, graph us."""
    import functools

    from fp4dispatch.kernels import fused, gluon_host
    for n, k, m, cfg in PICKS:
        ops = rand_operands(m, n, k, seed=m)
        res = []
        for t in tiles:
            # gluon_host holds its own name for it; _wgds.run imports it from fused at call time
            gluon_host.predecode = fused.predecode = functools.partial(predecode, tile=t)
            try:
                us = graph_ms(lambda: fused.fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out,
                                                     cfg)) * 1e3
            finally:
                gluon_host.predecode = fused.predecode = predecode
            res.append(f"{'x'.join(map(str, t))} {us:.1f}")
        print(f"N={n} K={k} M={m} {cfg['kernel']} us by pre-decode tile: " + ", ".join(res), flush=True)


if __name__ == "__main__":
    arg = sys.argv[sys.argv.index("--tiles") + 1] if "--tiles" in sys.argv else None
    tiles = tuple(tuple(map(int, t.split(","))) for t in arg.split(";")) if arg else TILES
    main(tiles)
    if "--e2e" in sys.argv:
        e2e(tiles)
