"""Warp-specialized Gluon NVFP4 GEMM for M >= 64 on SM90: a measured experiment, not a backend (issue 8, seventh
session; benchmarks/RESULTS.md runs 1-5, notes_hopper.md v11).

The ``wmma`` M=128 pick keeps the tensor cores 41 % busy (ncu): its loop waits for its own cp.async data, passes a CTA
barrier every K step and decodes in the same warps that issue wgmma. This kernel splits the loads off:
- one producer warp streams the weight words and the pre-decoded activation (``fused.decode_a``) by TMA into a
  STAGES-deep ring (``ready`` mbarriers, one per slot);
- the default partition (one warpgroup per 64 weight rows) waits for a slot, decodes the words straight into the
  register operand of an async wgmma (``wmma``'s ``_dec16``; the convert to the operand layout is trivial), keeps
  WAIT wgmma groups in flight and frees the slot of the step before (``empty`` mbarriers).
What the H200 said: not faster. M=128 (8192^2): 53.4 us against the pick's 46.9; with no loads at all after the first
STAGES steps still 49.2, so not load-bound; ncu: 40 % of the stall cycles at the partition barrier that Triton 3.6
puts before every mbarrier arrive (only thread 0 arrives), issue 21 %, tensor pipe 43 %. M=1024 with BM 128: 3-6 %
faster than the pick, 0.68-0.71x cuBLAS bf16. BM 256 with one group in flight across steps (WAIT 1) gives WRONG
results (rel err 0.5-1.2): nothing keeps ptxas from reusing the register operand of a wgmma still in flight
(its times, 0.87x cuBLAS on 8192x28672, only bound what a safe pipelining could give); with WAIT 0 it is exact and
slower than the pick. BM 128 with WAIT 1 passed run 2's checks after its BKB 4 tile failed run 1's with the same
compiled loop (run 2 tied the old operand to the wait; the review found that leaves the SASS byte-identical and
removed it), so it has the same race: its times are not a result either.
Triton 3.6 limits met on the way: constexpr partition arguments arrive as i32 values (sizes come from buffer types,
variants from wrapper functions); two 4-warp consumer partitions made ptxas serialize every wgmma (C7512
"insufficient register resources", whatever the register split); one 8-warp partition does not.

    python3 benchmarks/gluon_ws.py --compile 128 128 8 4 1    # local sm_90a build (BN BM BKB STAGES WAIT), no GPU
    python3 benchmarks/gluon_ws.py [--large] [--no-check]     # H200: exactness, then M=128 (or M >= 256) timings
    ncu --profile-from-start off ... python3 benchmarks/gluon_ws.py --profile 128 8 4 2 1 0
"""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import build, epilogue, layouts, mma_step, raw_layout, scale_ptrs, signature  # noqa: E402


@gluon.jit
def _producer(b_desc, a_desc, w_s, a_s, ready, empty, n0, m0, st0, steps, skip):
    """TMA loads into the ring. ``skip`` (timing experiments only, wrong results): bit 0 loads the activation only
    into the first STAGES slots, bit 1 the same for the weight words, so that step costs no such traffic."""
    # (Triton 3.6 passes a worker partition's constexpr arguments as i32 values: sizes come from the buffers' types)
    STAGES: gl.constexpr = w_s.type.shape[0]
    BKB: gl.constexpr = w_s.type.shape[2]
    WB: gl.constexpr = w_s.type.shape[1] * BKB * 8
    AB: gl.constexpr = a_s.type.shape[1] * BKB * 32
    for it in range(steps):
        s = it % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        la = ((skip & 1) == 0) | (it < STAGES)
        lw = ((skip & 2) == 0) | (it < STAGES)
        mbarrier.expect(ready.index(s), WB + AB, pred=la & lw)
        mbarrier.expect(ready.index(s), WB, pred=lw & (not la))
        mbarrier.expect(ready.index(s), AB, pred=la & (not lw))
        mbarrier.arrive(ready.index(s), pred=(not la) & (not lw))
        tma.async_copy_global_to_shared(b_desc, [n0, (st0 + it) * BKB], ready.index(s), w_s.index(s), pred=lw)
        tma.async_copy_global_to_shared(a_desc, [m0, (st0 + it) * BKB * 16], ready.index(s), a_s.index(s), pred=la)


@gluon.jit
def _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB, WAIT: gl.constexpr):
    """acc [BN, BM] = W @ A.T for the tile's BN = 16 * num_warps weight rows (a warpgroup per 64), then alpha and
    fp32 atomics. WAIT: wgmma groups left in flight at the end of a step (1; 0 for experiments)."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    RAW: gl.constexpr = raw_layout(BKB, BN // 16)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BN // 16, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    sptr, smask = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
    sb = gl.load(sptr + (st0 * BKB // 4) * 512, mask=smask, other=0)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    for it in range(steps):
        sb_next = gl.load(sptr + ((st0 + it + 1) * BKB // 4) * 512, mask=smask & (it + 1 < steps), other=0)
        acc = mma_step(w_s, a_s, ready, it, sb, acc, RAW, DOT)
        # WAIT 1: the group of step it-1 is done, so its slot (words read into registers before it, activation read
        # by it) is free. NOT SAFE: nothing keeps ptxas from giving the next step's decoded operand the registers of
        # this step's, still in flight (BM 256 is wrong; BM 128 passed run 2's checks after failing run 1's, same
        # SASS; tying the old operand to this wait left the SASS byte-identical). No proxy fence: the words were
        # read before this step's wgmma was issued (CUTLASS's TMA pipeline releases the same way), and a fence here
        # compiles to MEMBAR.ALL.CTA, which would wait for the scale prefetch every step.
        acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc])
        mbarrier.arrive(empty.index((it + STAGES - WAIT) % STAGES), pred=it >= WAIT)
        sb = sb_next
    epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, gl.num_programs(2) > 1)

@gluon.jit
def _consume_wait1(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB, 1)


@gluon.jit
def _consume_wait0(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB, 0)


@gluon.jit
def ws_kernel(b_desc, a_desc, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, steps_per_split, skip, BN: gl.constexpr,
              BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr = 1):
    """Tile of BN weight rows x BM tokens over one K split (program_id 2): the default partition (num_warps =
    BN / 16) consumes, one worker warp loads."""
    n0 = gl.program_id(0) * BN
    m0 = gl.program_id(1) * BM
    st0 = gl.program_id(2) * steps_per_split
    steps = gl.minimum(KB // BKB - st0, steps_per_split)
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], b_desc.layout)
    a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BKB * 16], a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, CB)
    load = (b_desc, a_desc, w_s, a_s, ready, empty, n0, m0, st0, steps, skip)
    # (Triton 3.6 turns constexpr partition arguments into i32 values, so WAIT is fixed by the function called)
    if WAIT == 1:
        gl.warp_specialize([(_consume_wait1, args), (_producer, load)], [1], [40])
    else:
        gl.warp_specialize([(_consume_wait0, args), (_producer, load)], [1], [40])


def compile_only(BN=128, BM=128, BKB=8, STAGES=4, WAIT=1):
    build(ws_kernel, dict(signature(BN, BM, BKB), skip="i32"),
          {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "WAIT": WAIT}, BN // 16,
          ("sb_ptr", "out_ptr", "KB", "CB", "N"))


def setup(ops, m, n, k, BN, BM, BKB, split):
    """A launcher for one problem: A decoded as wmma's APRE does, then the kernel (split K: fp32 out, zeroed for its
    atomics; whole K: out in ops.out's dtype)."""
    from fp4dispatch.kernels.fused import decode_a
    kb, cb = k // 16, triton.cdiv(k // 16, 4)
    bl, al = layouts(BN, BM, BKB)
    bd = TensorDescriptor.from_tensor(ops.b.view(torch.int64), [BN, BKB], bl)
    sa, sb = ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8)
    per = triton.cdiv(kb // BKB, split)
    grid = (triton.cdiv(n, BN), triton.cdiv(m, BM), triton.cdiv(kb // BKB, per))
    out = torch.empty((m, n), dtype=torch.float32 if grid[2] > 1 else ops.out.dtype, device="cuda")

    def run(stages, wait=1, skip=0):
        ad = decode_a(ops.a.view(torch.int64), sa, m, kb, cb, True, CVT=True)
        add = TensorDescriptor.from_tensor(ad, [BM, BKB * 16], al)
        if grid[2] > 1:
            out.zero_()
        ws_kernel[grid](bd, add, sb, ops.alpha, out, m, n, kb, cb, per, skip, BN=BN, BM=BM, BKB=BKB, STAGES=stages,
                        WAIT=wait, num_warps=BN // 16)
        return out
    return run


CHECKS = ((128, 8, 1, 4, 1), (128, 4, 3, 6, 1), (128, 4, 3, 6, 0), (256, 8, 1, 3, 1), (256, 8, 2, 2, 1),
          (256, 4, 1, 5, 1), (256, 8, 1, 3, 0), (256, 4, 3, 5, 0))  # (BM, BKB, split, stages, wait)


def check() -> None:
    """Exactness against the float64 reference: fp32 out with split K (atomics), bf16 out without."""
    from bench_hopper import rand_operands, ref64, rel_err
    for m, n, k in ((128, 1024, 4096), (3, 512, 2048), (300, 640, 8192)):
        for dt in (torch.float32, torch.bfloat16):
            ops = rand_operands(m, n, k, seed=11, out_dtype=dt, scale_lo=0x01, scale_hi=0x50)
            ref = ref64(ops, m, n, k)
            for bm, bkb, split, stages, wait in CHECKS:
                if (split > 1) != (dt == torch.float32):
                    continue
                o = setup(ops, m, n, k, 128, bm, bkb, split)(stages, wait)
                torch.cuda.synchronize()
                print(f"check m={m} n={n} k={k} {str(o.dtype)[6:]} BM={bm} BKB={bkb} split={split} stages={stages} "
                      f"wait={wait}: rel err {rel_err(o, ref):.3g}", flush=True)


def exp_m128() -> None:
    """Seventh session, run 2: M=128 against the wmma pick; skip drops loads (timing only)."""
    from bench_hopper import graph_ms, rand_operands
    from fp4dispatch.kernels.fused import fused_mm
    pick = {"kernel": "wmma", "BM": 128, "BN": 128, "BKB": 8, "warps": 8, "stages": 3, "split": 2, "APRE": True}
    for n, k in ((8192, 8192), (28672, 8192)):
        m = 128
        ops = rand_operands(m, n, k, seed=m)
        t = graph_ms(lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, pick))
        print(f"N={n} K={k} M={m} wmma pick: {t * 1e3:.1f} us", flush=True)
        # skip: timing experiments that drop the activation (1), weight (2) or both (3) loads after the first
        # STAGES steps; wait 0: no wgmma group in flight across steps
        for bkb, stages, split, wait, skip in ((8, 4, 2, 1, 0), (8, 4, 2, 0, 0), (8, 4, 2, 1, 1), (8, 4, 2, 1, 2),
                                               (8, 4, 2, 1, 3), (8, 4, 1, 1, 0), (8, 4, 1, 1, 1), (8, 4, 1, 1, 3)):
            r = setup(ops, m, n, k, 128, 128, bkb, split)
            t = graph_ms(lambda: r(stages, wait, skip))
            print(f"N={n} K={k} M={m} ws BN=128 BKB={bkb} stages={stages} split={split} wait={wait} skip={skip}: "
                  f"{t * 1e3:.1f} us", flush=True)


def exp_large() -> None:
    """Seventh session, run 3: M >= 256 (BM 256 tiles: twice the wgmma work per decoded weight value) against the
    dispatcher's M >= 512 wmma tile and cuBLAS bf16, bf16 out."""
    from bench_hopper import graph_ms, rand_operands
    from fp4dispatch.kernels.fused import fused_mm
    pick = {"kernel": "wmma", "BM": 256, "BN": 128, "BKB": 8, "warps": 8, "stages": 3, "split": 1, "APRE": True}
    for n, k, ms in ((8192, 8192, (256, 1024)), (28672, 8192, (1024,)), (8192, 28672, (1024,))):
        for m in ms:
            ops = rand_operands(m, n, k, seed=m)
            wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t = graph_ms(lambda: torch.mm(wa, wb.t()))
            print(f"N={n} K={k} M={m} cuBLAS bf16: {t * 1e3:.1f} us", flush=True)
            t = graph_ms(lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, pick))
            print(f"N={n} K={k} M={m} wmma 256x128: {t * 1e3:.1f} us", flush=True)
            # BM 256 with wait 1 gave wrong results (run 3-4): its times only bound what the pipelining could give
            for bm, bkb, stages, wait in ((256, 8, 3, 0), (256, 4, 5, 0), (256, 4, 6, 0), (256, 8, 3, 1),
                                          (256, 4, 5, 1), (128, 8, 4, 1)):
                r = setup(ops, m, n, k, 128, bm, bkb, 1)
                t = graph_ms(lambda: r(stages, wait))
                print(f"N={n} K={k} M={m} ws BM={bm} BKB={bkb} stages={stages} wait={wait}: {t * 1e3:.1f} us",
                      flush=True)


def profile(BN=128, BKB=8, STAGES=4, split=2, wait=1, skip=0) -> None:
    """One launch on 8192² M=128 inside cudaProfilerStart/Stop (warm-up outside), for
    ncu --profile-from-start off."""
    from bench_hopper import rand_operands
    ops = rand_operands(128, 8192, 8192, seed=128)
    r = setup(ops, 128, 8192, 8192, BN, 128, BKB, split)
    r(STAGES, wait, skip)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    r(STAGES, wait, skip)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        compile_only(*map(int, sys.argv[2:]))
    elif sys.argv[1:2] == ["--profile"]:
        profile(*map(int, sys.argv[2:]))
    else:
        if "--no-check" not in sys.argv:
            check()
        exp_large() if "--large" in sys.argv else exp_m128()
