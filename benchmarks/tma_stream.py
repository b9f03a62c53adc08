"""How fast a TMA ring streams an NVFP4 weight, box pattern by box pattern (issue 8, eleventh session).

gvws's feed alone (``gemv_ws.py --feed``: the library's producer, consumers that only take and free each slot)
capped at ~72 % of the FP4-byte roofline on the H200 at every ring depth, tile and CTA count tried. This streams
only the weight, through the same kind of ring, in boxes of the same size but different shapes, to tell the access
pattern from the ring:

    python3 benchmarks/tma_stream.py           # H200: the patterns
    python3 benchmarks/tma_stream.py --sizes   # H200: time against bytes, TMA ring against plain loads
    python3 benchmarks/tma_stream.py --placement   # H200: which SM each CTA of a 3-per-SM grid runs on

A pattern is an int64 view (D0, D1, D2) of the weight's bytes and a box (B0, B1, B2); a CTA takes a range of tiles
(D0/B0 x D1/B1 of them) and walks each along D2 (the K direction for the row views).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from fp4dispatch.kernels._gluon import _first_tile
    from fp4dispatch.kernels._gvws import plain

    @gluon.jit
    def produce(desc, w_s, ready, empty, T1, TILES, STEPS):
        STAGES: gl.constexpr = w_s.type.shape[0]
        B0: gl.constexpr = w_s.type.shape[1]
        B1: gl.constexpr = w_s.type.shape[2]
        B2: gl.constexpr = w_s.type.shape[3]
        lo = _first_tile(gl.program_id(0), TILES)
        for it in range((_first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
            tile = lo + it // STEPS
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), B0 * B1 * B2 * 8)
            tma.async_copy_global_to_shared(desc, [(tile // T1) * B0, (tile % T1) * B1, (it % STEPS) * B2],
                                            ready.index(s), w_s.index(s))

    @gluon.jit
    def consume(w_s, ready, empty, out_ptr, TILES, STEPS):
        STAGES: gl.constexpr = w_s.type.shape[0]
        NE: gl.constexpr = w_s.type.shape[1] * w_s.type.shape[2] * w_s.type.shape[3]
        L: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
        lo = _first_tile(gl.program_id(0), TILES)
        acc = gl.zeros([NE], gl.int64, L)
        for it in range((_first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc ^= w_s._reinterpret(gl.int64, [STAGES, NE], plain(1)).index(s).load(L)
            fence_async_shared()
            mbarrier.arrive(empty.index(s))
        gl.store(out_ptr + gl.program_id(0), gl.sum(acc, 0))

    @gluon.jit
    def stream_kernel(desc, out_ptr, T1, TILES, STEPS, B0: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr,
                      STAGES: gl.constexpr):
        w_s = gl.allocate_shared_memory(gl.int64, [STAGES, B0, B1, B2], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([(consume, (w_s, ready, empty, out_ptr, TILES, STEPS)),
                            (produce, (desc, w_s, ready, empty, T1, TILES, STEPS))], [1], [40])
    return stream_kernel


def patterns(n: int, kb: int) -> dict:
    """name -> (view, box) over the int64 words of an [n, kb*8]-byte weight; every box is 8 KB."""
    return {
        "gvws R=8 BW=32 (4 groups of 8 rows x 256 B)": ((n // 32, 32, kb), (4, 8, 32)),
        "32 rows x 256 B": ((n // 32, 32, kb), (1, 32, 32)),
        "16 rows x 512 B": ((n // 16, 16, kb), (1, 16, 64)),
        "8 rows x 1 KB": ((n // 8, 8, kb), (1, 8, 128)),
        "4 rows x 2 KB": ((n // 4, 4, kb), (1, 4, 256)),
        "contiguous 8 KB": ((n * kb // 1024, 4, 256), (1, 4, 256)),
    }


def sizes() -> None:
    """Graph us against bytes streamed, for the TMA ring (contiguous 8 KB boxes, 6 stages, 2 CTAs per SM) and a
    plain-load Triton kernel (one block per program), next to an empty graph node: a fixed cost and a rate."""
    from bench_hopper import copy_bandwidth, graph_ms

    from fp4dispatch.kernels._gvws import _layouts, reg_cap
    from fp4dispatch.kernels.launch import launch, tma_desc
    from methods import read_kernel
    kern, ldg = _kernel(), read_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    one = torch.zeros(1, device="cuda")
    print(f"graph of one 1-element fill: {graph_ms(lambda: one.fill_(1.0)) * 1e3:.1f} us", flush=True)
    for mb in (4, 16, 32, 64, 128, 256, 512):
        b = torch.randint(0, 256, (mb << 20,), dtype=torch.uint8, device="cuda")
        words = b.numel() // 8
        sink = torch.empty(words // 256 + 4 * sms, dtype=torch.int64, device="cuda")
        desc = tma_desc(b.data_ptr(), torch.int64, (words // 1024, 4, 256), (1024, 256, 1), (1, 4, 256),
                        _layouts()[0])
        res = [graph_ms(lambda: launch(kern, (min(words // 1024, 2 * sms),), desc, sink, 1, words // 1024, 1, B0=1,
                                       B1=4, B2=256, STAGES=6, num_warps=4, **reg_cap(4, 2))) * 1e3]
        for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
            res.append(graph_ms(lambda: ldg[(words // block,)](b.view(torch.int64), sink, words, BLOCK=block,
                                                               num_warps=warps)) * 1e3)
        print(f"{mb} MB: TMA ring {res[0]:.1f} us; plain loads (1024, 4 warps) {res[1]:.1f}, (2048, 4) {res[2]:.1f}, "
              f"(4096, 8) {res[3]:.1f} us; best {b.numel() / min(res) / 1e6:.2f} TB/s", flush=True)


def _where_kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def where(out_ptr):
        buf = gl.allocate_shared_memory(gl.int32, [16384], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # 64 KB
        L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        buf.slice(0, 128).store(gl.zeros([128], gl.int32, L))
        smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [buf.slice(0, 128).load(L)], dtype=gl.int32,
                                         is_pure=False, pack=1)
        gl.store(out_ptr + gl.program_id(0) * 128 + gl.arange(0, 128, L), smid)
    return where


def placement() -> None:
    """The SM of each CTA of a grid of 3 CTAs per SM (64 KB of shared memory each, so 3 fit): whether the hardware
    puts consecutive CTAs on one SM (then the first CTAs' extra tiles pile up on a few SMs) or spreads them."""
    where = _where_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full((3 * sms, 128), -1, dtype=torch.int32, device="cuda")
    where[(3 * sms,)](out, num_warps=4)
    sm = out[:, 0].tolist()
    print(f"CTA -> SM, first 12: {sm[:12]}; CTAs {3 * sms - 6}..: {sm[-6:]}", flush=True)
    per = {}
    for c, s in enumerate(sm):
        per.setdefault(s, []).append(c)
    print(f"{len(per)} SMs used; CTAs of SM {sm[0]}: {per[sm[0]]}; of SM {sm[1]}: {per[sm[1]]}", flush=True)


def main() -> None:
    if "--placement" in sys.argv:
        placement()
        return
    if "--sizes" in sys.argv:
        sizes()
        return
    from bench_hopper import copy_bandwidth, graph_ms

    from fp4dispatch.kernels._gvws import _layouts, reg_cap
    from fp4dispatch.kernels.launch import launch, tma_desc
    kern = _kernel()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for n, k in ((8192, 8192), (28672, 8192), (8192, 28672)):
        b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        sink = torch.empty(4 * sms, dtype=torch.int64, device="cuda")
        for name, (view, box) in patterns(n, k // 16).items():
            strides = (view[1] * view[2], view[2], 1)
            desc = tma_desc(b.data_ptr(), torch.int64, view, strides, box, _layouts()[0])
            t1, steps = view[1] // box[1], view[2] // box[2]
            tiles = view[0] // box[0] * t1
            for stages, ctas in ((6, 2), (12, 1), (4, 3)):
                t = graph_ms(lambda: launch(kern, (min(tiles, sms * ctas),), desc, sink, t1, tiles, steps, B0=box[0],
                                            B1=box[1], B2=box[2], STAGES=stages, num_warps=4,
                                            **reg_cap(4, ctas))) * 1e3
                print(f"{n}x{k} {name}, {stages} stages, {ctas} CTAs/SM: {t:.1f} us, "
                      f"{n * k / 2 / t / 1e6 / (bw / 1e12) * 100:.0f} % of copy", flush=True)


if __name__ == "__main__":
    main()
