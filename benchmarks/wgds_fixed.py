"""Where ``wgds``'s time goes besides its K steps (thirteenth session): graph us of the activation's pre-decode alone
and of the whole call, over K (the slope is the cost of a K step, the intercept the fixed cost of a CTA's tile) and
over split-K parts, timed two ways: ``do_bench`` (L2 flushed by a 256 MB write before each repeat, as the table) and
back-to-back replays (L2 warm, no flush).

    python3 benchmarks/wgds_fixed.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hopper import capture, graph_ms, rand_operands  # noqa: E402


def warm_ms(fn, reps: int = 50) -> float:
    """Mean ms of back-to-back CUDA-graph replays of ``fn`` (no L2 flush between them)."""
    g = capture(fn)
    for _ in range(5):
        g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def main() -> None:
    from fp4dispatch.kernels.fused import _WGDS, fused_mm, predecode

    cases = [(8192, k, 1) for k in (256, 2048, 8192)]
    cases += [(6144, 2048, s) for s in (1, 4)] + [(2048, 6144, s) for s in (1, 4)]
    for n, k, split in cases:
        m = 128
        ops = rand_operands(m, n, k, seed=k + split)
        cfg = dict(_WGDS, split=split)

        def call():
            fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)

        def pre():
            predecode(ops.a.view(torch.int64), ops.a_scale.view(torch.uint8), True, CVT=True)
        steps = -(-k // 128)
        print(f"N={n} K={k} steps={steps} split={split}: call {graph_ms(call) * 1e3:.1f} us flushed, "
              f"{warm_ms(call) * 1e3:.1f} warm; predecode {graph_ms(pre) * 1e3:.1f} flushed, "
              f"{warm_ms(pre) * 1e3:.1f} warm", flush=True)


if __name__ == "__main__":
    main()
