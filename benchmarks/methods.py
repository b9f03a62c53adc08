"""How the timing method moves the issue-8 ratios (eleventh session): the dispatcher's pick, cuBLAS bf16 and a kernel
that only reads the FP4 weight bytes, timed three ways on the same data.

- ``flush-write``: ``triton.testing.do_bench`` as the table uses it. Before each repeat it zeroes a 256 MB buffer,
  so L2 is full of dirty lines when the timed kernel starts, and its first reads evict them to DRAM: for a while
  the kernel shares DRAM with write-backs.
- ``flush-read``: CUDA events around one call, after a kernel that only reads a 256 MB buffer (L2 then holds clean
  lines); median of the repeats.
- ``rotate``: one CUDA graph of calls on enough distinct weight copies that none is in L2 when its call starts, as in
  a model's layer after layer; the graph's median replay time over the calls.

    python3 benchmarks/methods.py [--ms 1,16] [--shapes 8192x8192,28672x8192,8192x28672]   # H200
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def read_kernel():
    """A Triton kernel that reads every int64 word of a buffer once (one BLOCK per program, a sum per program)."""
    import triton.language as tl

    @triton.jit
    def read_all(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0), 0))
    return read_all


_READ = None


def read_bytes(x: torch.Tensor, sink: torch.Tensor) -> None:
    """Read every byte of contiguous ``x`` once (int64 words; 16 KB per program): the floor of any kernel that
    must read them."""
    global _READ
    _READ = _READ or read_kernel()
    w = x.view(torch.int64)
    _READ[(triton.cdiv(w.numel(), 2048),)](w, sink, w.numel(), BLOCK=2048, num_warps=4)


def times_us(fns, reps: int = 30) -> dict:
    """us per call of ``fns`` (calls on distinct weight copies) by the three methods."""
    from bench_hopper import bench_ms, capture
    one = capture(fns[0])
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.empty(triton.cdiv(flush.numel() // 8, 2048), dtype=torch.int64, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        read_bytes(flush, sink)
        s.record()
        one.replay()
        e.record()
    torch.cuda.synchronize()
    flush_read = sorted(s.elapsed_time(e) for s, e in ev)[reps // 2]
    rot = capture(*fns)
    for s, e in ev:
        s.record()
        rot.replay()
        e.record()
    torch.cuda.synchronize()
    rotate = sorted(s.elapsed_time(e) for s, e in ev)[reps // 2] / len(fns)
    return {"flush-write": bench_ms(one.replay) * 1e3, "flush-read": flush_read * 1e3, "rotate": rotate * 1e3}


def main() -> None:
    from bench_hopper import copy_bandwidth, rand_operands

    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.problem import Problem
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,16")
    p.add_argument("--shapes", default="8192x8192,28672x8192,8192x28672")
    args = p.parse_args()
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 >> 20} MB", flush=True)
    d = Dispatcher(cache_dir=tempfile.mkdtemp(prefix="fp4c-methods-"))
    for shape in args.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        copies = max(2, triton.cdiv(4 * l2, n * k * 9 // 16))  # fp4 weights, so bf16's (3.6x larger) rotate too
        wbs = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (int(x) for x in args.ms.split(",")):
            prob = Problem(m, n, k, torch.bfloat16, torch.device("cuda"))
            choice = d.choose(prob)
            ops = [rand_operands(m, n, k, seed=c) for c in range(copies)]
            wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sinks = [torch.empty(triton.cdiv(o.b.numel() // 8, 2048), dtype=torch.int64, device="cuda") for o in ops]
            res = {
                "pick": times_us([lambda o=o: choice.backend.run(prob, o, choice.config) for o in ops]),
                "cuBLAS bf16": times_us([lambda w=w: torch.mm(wa, w.t()) for w in wbs]),
                "read FP4 weight": times_us([lambda o=o, s=s: read_bytes(o.b, s) for o, s in zip(ops, sinks)]),
            }
            roof = ((m + n) * k * 9 / 16 + 2 * m * n) / bw * 1e6
            print(f"{n}x{k} M={m} ({copies} copies; pick {choice.backend.name} {choice.config}); roofline "
                  f"{roof:.1f} us", flush=True)
            for method in ("flush-write", "flush-read", "rotate"):
                t = {name: r[method] for name, r in res.items()}
                print(f"  {method}: pick {t['pick']:.1f} us ({roof / t['pick'] * 100:.0f} % roofline, "
                      f"{t['cuBLAS bf16'] / t['pick']:.2f}x bf16), cuBLAS bf16 {t['cuBLAS bf16']:.1f}, read FP4 "
                      f"weight {t['read FP4 weight']:.1f} ({roof / t['read FP4 weight'] * 100:.0f} % roofline)",
                      flush=True)
        del wbs


if __name__ == "__main__":
    main()
