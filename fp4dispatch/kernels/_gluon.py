"""``wgws``: the warp-specialized NVFP4 GEMM for SM90 in Gluon (``triton.experimental.gluon``); host side:
``fused.py``. Only imported where :func:`gluon_missing` says it can be.

``acc[BN, BM] = W @ A.T``, as ``wmma`` (``_wmma.py``), but without Triton's pipeliner:
- a producer warp streams the weight words and the pre-decoded activation (``fused.decode_a``) by TMA into a
  STAGES-deep shared-memory ring (``ready`` mbarriers, one per slot; zero-filled past N, M and K);
- the default partition (a warpgroup per 64 weight rows) waits for a slot, decodes the words straight into the
  register operand of an async wgmma (``wmma``'s ``_dec16``, with CVT; the convert to the operand layout is free in
  ``raw_layout``), leaves one wgmma group in flight while it decodes the next step, and frees the slot whose group
  is done (``empty`` mbarriers);
- the epilogue applies alpha in fp32 and stores through ``store_layout`` (rows of out along n).
H200 (benchmarks/RESULTS.md, eighth session): M=1024 on the large shapes 0.89-0.99x cuBLAS bf16 across runs, where
``wmma``'s 256x128 tile made 0.59-0.69x; the dispatcher's pick from M = 1024 on those shapes.

Two things a correct version needed (benchmarks/notes_hopper.md v12):
- the consumer loop runs two K steps per pass. A rolled loop decodes every step into the same registers, and with
  a group in flight the decode overwrote the operand that group was still reading (wrong results at BM 256);
  unrolled, each step's operand is its own value and ptxas gives it its own registers;
- the epilogue moves the tile into ``store_layout`` first: stored from the wgmma layout, each thread wrote 2-byte
  values N apart, ~4500 instructions with register spills per 128x256 tile, ~50 us per tile.
"""
from __future__ import annotations

import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import _fused, _wmma

# the decode and the scale addressing are wmma's own: Gluon compiles a @triton.jit function's body with its semantics
_dec16 = gluon.jit(_wmma._dec16.fn)
_scale_cols = gluon.jit(_wmma._scale_cols.fn)
_swz_row = gluon.jit(_fused._swz_row.fn)


@triton.constexpr_function
def raw_layout(bkb: int, warps: int = 4) -> gl.DistributedLinearLayout:
    """The layout of a [16 * warps, bkb] tile of weight words in which the decoded weight is already the wgmma
    register operand (warps_per_cta [warps, 1]), so the convert to DotOperandLayout is free. Lanes hold the 4 blocks
    of a scale group; registers take row 8 and the further groups; each warp 16 rows."""
    bkb, warps = getattr(bkb, "value", bkb), getattr(warps, "value", warps)
    regs = [[8, 0]] + [[0, 4 << i] for i in range(bkb.bit_length() - 3)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)],
                                      block_bases=[], shape=[16 * warps, bkb])


@triton.constexpr_function
def store_layout(bn: int) -> gl.BlockedLayout:
    """The out.T tile [bn, BM] (accumulated by bn // 16 warps) with 8 consecutive weight rows per thread: out's rows
    run along n, so a thread writes 16 contiguous bytes of bf16 and a warp whole rows (any BM: warps tile along m)."""
    bn = getattr(bn, "value", bn)
    t0 = min(bn // 8, 32)
    return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[t0, 32 // t0], warps_per_cta=[1, bn // 16],
                            order=[0, 1])


@gluon.jit
def scale_ptrs(sb_ptr, n0, CB, N, BN: gl.constexpr, BKB: gl.constexpr, RAW: gl.constexpr):
    """Pointers at K step 0, row mask and block index within a step of the e4m3 scale bytes of weight rows
    [n0, n0 + BN), in RAW's layout (``load_scales`` reads one step)."""
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, RAW))
    t = gl.arange(0, BKB, layout=gl.SliceLayout(0, RAW))
    return sb_ptr + _swz_row(rn, CB)[:, None] + _scale_cols(t)[None, :], (rn < N)[:, None], t


@gluon.jit
def load_scales(sptr, smask, t, kb0, KB):
    """Scale bytes of the step that starts at block kb0 (a multiple of 4); 0 past K, whatever the padding holds."""
    return gl.load(sptr + (kb0 // 4) * 512, mask=smask & (kb0 + t < KB)[None, :], other=0)


@gluon.jit
def mma_step(w_s, a_s, ready, it, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr):
    """Step ``it`` of the ring: wait for its slot, decode the weight words (scales ``sb``) straight into the wgmma
    register operand and issue the async wgmma with the slot's A tile."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BKB: gl.constexpr = w_s.type.shape[2]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    w = gl.convert_layout(_dec16(w_s.index(s).load(RAW), sb, BKB, True, True), DOT, assert_trivial=True)
    return warpgroup_mma(w, a_s.index(s).permute((1, 0)), acc, is_async=True)


@gluon.jit
def epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, atomic):
    """Wait for the last wgmma, apply alpha and write out.T's tile through ``store_layout``: fp32 atomics into a
    zeroed out (``atomic``: a split of K) or a store in out's dtype."""
    ST: gl.constexpr = store_layout(acc.type.shape[0])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    acc = acc * (0.25 * gl.load(alpha_ptr))  # 2**-2 undoes the CVT decode's factor 2 on each operand
    on = n0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, ST))
    om = m0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, ST))
    offs = om[None, :].to(gl.int64) * N + on[:, None]
    mask = (om[None, :] < M) & (on[:, None] < N)
    if atomic:
        gl.atomic_add(out_ptr + offs, gl.convert_layout(acc, ST), mask=mask, sem="relaxed")
    else:
        gl.store(out_ptr + offs, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), ST), mask=mask)


@gluon.jit
def _producer(b_desc, a_desc, w_s, a_s, ready, empty, n0, m0, st0, steps):
    """TMA loads of K steps [st0, st0 + steps) into the ring."""
    # (Triton 3.6 passes a worker partition's constexpr arguments as i32 values: sizes come from the buffers' types)
    STAGES: gl.constexpr = w_s.type.shape[0]
    BKB: gl.constexpr = w_s.type.shape[2]
    NBYTES: gl.constexpr = w_s.type.shape[1] * BKB * 8 + a_s.type.shape[1] * BKB * 32
    for it in range(steps):
        s = it % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        tma.async_copy_global_to_shared(b_desc, [n0, (st0 + it) * BKB], ready.index(s), w_s.index(s))
        tma.async_copy_global_to_shared(a_desc, [m0, (st0 + it) * BKB * 16], ready.index(s), a_s.index(s))


@gluon.jit
def _release(w_s, a_s, ready, empty, it, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr):
    """Step ``it``: decode and issue its wgmma, wait until one group is left in flight, then free the slot of step
    it - 1, whose group is done. No proxy fence: the words were read into registers before that group was issued
    (CUTLASS's TMA pipeline releases the same way), and a fence here compiles to MEMBAR.ALL.CTA."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    acc = mma_step(w_s, a_s, ready, it, sb, acc, RAW, DOT)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it >= 1)
    return acc


@gluon.jit
def _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N, KB, CB):
    """acc [BN, BM] = W @ A.T for the tile's BN = 16 * num_warps weight rows (a warpgroup per 64), then the
    epilogue (atomics when the grid splits K)."""
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    RAW: gl.constexpr = raw_layout(BKB, BN // 16)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BN // 16, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    sptr, smask, t = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
    sb = load_scales(sptr, smask, t, st0 * BKB, KB)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    # Two steps per pass, so that two values hold the decoded operands: a step's decode runs while the step before's
    # wgmma still reads its register operand. In a rolled loop both are one value with the same registers.
    for p in range(steps // 2):
        kb0 = (st0 + 2 * p) * BKB
        sb1 = load_scales(sptr, smask, t, kb0 + BKB, KB)
        acc = _release(w_s, a_s, ready, empty, 2 * p, sb, acc, RAW, DOT)
        sb = load_scales(sptr, smask, t, kb0 + 2 * BKB, KB)
        acc = _release(w_s, a_s, ready, empty, 2 * p + 1, sb1, acc, RAW, DOT)
    if steps % 2 == 1:
        acc = _release(w_s, a_s, ready, empty, steps - 1, sb, acc, RAW, DOT)
    epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, gl.num_programs(2) > 1)


@gluon.jit
def wgws_kernel(b_desc, a_desc, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, steps_per_split, BN: gl.constexpr,
                BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr):
    """Tile of BN weight rows x BM tokens over one K split (program_id 2; fp32 atomics into a zeroed out when there
    are several): the default partition (num_warps = BN / 16) consumes, one worker warp loads."""
    n0 = gl.program_id(0) * BN
    m0 = gl.program_id(1) * BM
    st0 = gl.program_id(2) * steps_per_split
    steps = gl.minimum(gl.cdiv(KB, BKB) - st0, steps_per_split)
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], b_desc.layout)
    a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BKB * 16], a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([(_consume, (w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, n0, m0, st0, steps, M, N,
                                    KB, CB)),
                        (_producer, (b_desc, a_desc, w_s, a_s, ready, empty, n0, m0, st0, steps))], [1], [40])


@functools.lru_cache(maxsize=None)
def layouts(BN: int, BM: int, BKB: int) -> tuple:
    """Shared-memory layouts of a [BN, BKB] weight-word tile and a [BM, BKB*16] pre-decoded A tile (TMA and wgmma).
    The word tile takes the default for int64: a fixed 128-byte swizzle fails for BKB < 16. Cached: building them
    took ~38 us of host time per call."""
    return (gl.NVMMASharedLayout.get_default_for([BN, BKB], gl.int64),
            gl.NVMMASharedLayout.get_default_for([BM, BKB * 16], gl.float16))
