"""Host time of an eager ``gvws`` call: its four TMA descriptors rebuilt every call (as first written: a view and a
``TensorDescriptor`` each) against ``_gvws.descriptors`` (cached by address and view), alternately in one process
(issue 8, tenth session; benchmarks/RESULTS.md run 10).

    python3 benchmarks/gvws_host.py      # H200: do_bench of eager calls and a 200-call host loop, M = 1
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hopper import bench_ms, rand_operands  # noqa: E402

from fp4dispatch.kernels import _gvws  # noqa: E402
from fp4dispatch.kernels import launch as L  # noqa: E402
from fp4dispatch.kernels.fused import fused_mm  # noqa: E402

CACHED = _gvws.descriptors


def rebuilt(a, b, sa, sb, R, BW, MB):
    """The descriptors as the first version built them on every call."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    n, kb = b.shape[0], b.shape[1] // 8
    cb = -(-kb // 4)
    wl, wsl, al, asl = _gvws._layouts()

    def scales(s):
        return s.view(torch.int32).as_strided((s.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1))
    w = b.view(torch.int64).as_strided((n // 32, 32, kb), (32 * kb, kb, 1))
    return (TensorDescriptor.from_tensor(w, [4, R, BW], wl),
            TensorDescriptor.from_tensor(scales(sb), [1, BW // 4, 4 * R], wsl),
            TensorDescriptor.from_tensor(a.view(torch.int64), [MB, BW], al),
            TensorDescriptor.from_tensor(scales(sa), [1, BW // 4, 4 * MB], asl))


def main() -> None:
    cfg = {"kernel": "gvws", "MB": 1, "R": 8, "BW": 32, "stages": 6, "warps": 4, "ctas": 3}
    for name, build in (("rebuilt", rebuilt), ("cached", CACHED), ("rebuilt", rebuilt)):
        _gvws.descriptors = build
        for n, k in ((8192, 8192), (28672, 8192)):
            ops = rand_operands(1, n, k, seed=1)

            def run():
                fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
            run()
            torch.cuda.synchronize()
            t = bench_ms(run) * 1e3
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                run()
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{name} {n}x{k}: do_bench {t:.1f} us, host loop {host:.1f} us/call, direct launches {L._fast}",
                  flush=True)
    _gvws.descriptors = CACHED


if __name__ == "__main__":
    main()
