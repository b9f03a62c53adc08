"""``wgws``: the warp-specialized NVFP4 GEMM for SM90 in Gluon (``triton.experimental.gluon``); host side:
``fused.py``. Only imported where :func:`gluon_missing` says it can be.

``acc[BN, BM] = W @ A.T``, as ``wmma`` (``_wmma.py``), but without Triton's pipeliner:
- a producer warp streams the weight words and the pre-decoded activation (``fused.predecode``) by TMA into a
  STAGES-deep shared-memory ring (``ready`` mbarriers, one per slot; zero-filled past N, M and K);
- the default partition (a warpgroup per 64 weight rows) waits for a slot, decodes the words straight into the
  register operand of an async wgmma (``wmma``'s ``_dec16``, with CVT; the convert to the operand layout is free in
  ``raw_layout``), leaves one wgmma group in flight while it decodes the next step, and frees the slot whose group
  is done (``empty`` mbarriers);
- the epilogue applies alpha in fp32 and stores through ``store_layout`` (rows of out along n).
H200 (benchmarks/RESULTS.md, eighth session): M=1024 on the large shapes 0.89-0.99x cuBLAS bf16 across runs, where
``wmma``'s 256x128 tile made 0.59-0.69x; the dispatcher's pick from M = 1024 on those shapes.

Ninth session: a CTA runs a range of whole tiles (``_first_tile``), so a grid of one CTA per SM is persistent (the
producer loads the next tile while the consumers finish one); and the two operands can swap roles (``SWAP``): the
activation decoded in registers, the weight pre-decoded, out = acc instead of acc.T, which decodes fewer values where
M > N. A stream-K cut with a workspace reduction was exact but slower in every cell measured, so it was removed
(notes_hopper.md v13); so was split K with ``_wgds``'s cheaper partial sums (fourteenth session: slower than the
best whole-tile config in every small-shape cell at M = 1024 and 4096, v18).

Fourteenth session: launched with PDL after the pre-decode, whose CTAs let it launch once the kernels before are
done; only the producer waits for the pre-decode (``gdc_wait``). H200: 0-1.5 us less per call at M >= 1024.

Sixteenth session: the consumers load a step's scale bytes two steps ahead instead of one; the wait for them was
their largest stall (ncu: 14.5 % of all samples, on one instruction). H200: 2-5 % less per call on the small shapes
at M = 1024 (2048x6144 46.2 -> 44.1 us), 0.86-0.87x cuBLAS bf16 on 6144x2048 and 2048x6144 where the fifteenth
session's table had 0.81-0.82x; 8192² at M = 1024 186.8 -> 179.1 us (benchmarks/RESULTS.md sixteenth session).

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
from triton.language.extra.cuda import gdc_wait  # Triton >= 3.4, as Gluon 3.6 itself

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
def store_layout(bn: int, bm: int, swap: bool, warps: int) -> gl.BlockedLayout:
    """The layout in which the [bn, bm] tile (accumulated by ``warps`` warps) is written, so that each thread writes
    16 contiguous bytes of bf16 and a warp whole runs of a row of out: out's rows run along the tile's first dim
    (8 consecutive rows of it per thread, warps along the second), or with ``swap`` (out = X @ Y.T, not its
    transpose) along the second."""
    bn, bm, swap, warps = (getattr(v, "value", v) for v in (bn, bm, swap, warps))
    if swap:
        t1 = min(bm // 8, 32)
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // t1, t1], warps_per_cta=[warps, 1],
                                order=[1, 0])
    t0 = min(bn // 8, 32)
    return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[t0, 32 // t0], warps_per_cta=[1, warps],
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
def _first_tile(c, TILES):
    """The first of CTA c's tiles: TILES are shared out in order, TILES // grid per CTA and one more to the first
    TILES % grid (a grid of TILES CTAs: one each)."""
    return c * (TILES // gl.num_programs(0)) + gl.minimum(c, TILES % gl.num_programs(0))


@gluon.jit
def _tile_offsets(n0, m0, M, N, BN: gl.constexpr, BM: gl.constexpr, L: gl.constexpr, SWAP: gl.constexpr,
                  QR: gl.constexpr = 0, R0: gl.constexpr = 0):
    """(int64 offset of the tile's first row, int32 offsets from it, mask) of the [BN, BM] tile at (n0, m0) of out
    [M, N] (acc.T), or with SWAP of out [N, M] (acc), in layout L: int32 offsets need half the registers of int64
    ones. With QR, the tile's rows are QR rows of each 32-row quarter from n0 (``_wgds``), else BN rows. R0: the
    rows are rows R0.. of a larger tile (a chunk of it)."""
    rn = R0 + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    if QR:
        rn = n0 + (rn // QR) * 32 + rn % QR
    else:
        rn = n0 + rn
    rm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, L))
    if SWAP:
        corner = n0.to(gl.int64) * M
        offs = (rn - n0)[:, None] * M + rm[None, :]
    else:
        corner = m0.to(gl.int64) * N
        offs = (rm - m0)[None, :] * N + rn[:, None]
    return corner, offs, (rm < M)[None, :] & (rn < N)[:, None]


@gluon.jit
def epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP: gl.constexpr, QR: gl.constexpr = 0):
    """Apply alpha in fp32 and write the finished tile (wgmma done) through ``store_layout`` (QR: ``_tile_offsets``)."""
    ST: gl.constexpr = store_layout(acc.type.shape[0], acc.type.shape[1], SWAP, gl.num_warps())
    corner, offs, mask = _tile_offsets(n0, m0, M, N, acc.type.shape[0], acc.type.shape[1], ST, SWAP, QR)
    acc = acc * (0.25 * gl.load(alpha_ptr))  # 2**-2 undoes the CVT decode's factor 2 on each operand
    gl.store(out_ptr + corner + offs, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), ST), mask=mask)


@gluon.jit
def _producer(b_desc, a_desc, w_s, a_s, ready, empty, TILES, NT, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring: it runs on into the next tile while the
    consumers finish one."""
    # (Triton 3.6 passes a worker partition's constexpr arguments as i32 values: sizes come from the buffers' types)
    STAGES: gl.constexpr = w_s.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    NBYTES: gl.constexpr = BN * BKB * 8 + BM * BKB * 32
    # The kernel's one wait for the kernel before (programmatic dependent launch): the pre-decode, which lets this
    # kernel launch once the kernels before it are done; the consumers read only inputs from before that and wait
    # for the ring. (Safe without PDL: then the pre-decode is done already.)
    gdc_wait()
    lo = _first_tile(gl.program_id(0), TILES)
    for j in range((_first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
        tile = lo + j // STEPS
        ks = j % STEPS
        s = j % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        tma.async_copy_global_to_shared(b_desc, [(tile % NT) * BN, ks * BKB], ready.index(s), w_s.index(s))
        tma.async_copy_global_to_shared(a_desc, [(tile // NT) * BM, ks * BKB * 16], ready.index(s), a_s.index(s))


@gluon.jit
def _release(w_s, a_s, ready, empty, it, prev, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr):
    """Ring step ``it``: decode and issue its wgmma, wait until one group is left in flight, then free the slot of
    step it - 1 (``prev``: it is this tile's), whose group is done. No proxy fence: the words were read into
    registers before that group was issued (CUTLASS's TMA pipeline releases the same way), and a fence here
    compiles to MEMBAR.ALL.CTA."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    acc = mma_step(w_s, a_s, ready, it, sb, acc, RAW, DOT)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=prev)
    return acc


@gluon.jit
def _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS,
             SWAP: gl.constexpr):
    """For each of this CTA's tiles: acc [BN, BM] = X @ Y.T (a warpgroup per 64 of the BN = 16 * num_warps rows),
    then the epilogue."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    RAW: gl.constexpr = raw_layout(BKB, BN // 16)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BN // 16, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    lo = _first_tile(gl.program_id(0), TILES)
    for tile in range(lo, _first_tile(gl.program_id(0) + 1, TILES)):
        j = (tile - lo) * STEPS  # the ring step of the tile's first K step
        n0 = (tile % NT) * BN
        m0 = (tile // NT) * BM
        sptr, smask, t = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
        sb0 = load_scales(sptr, smask, t, 0, KB)
        sb1 = load_scales(sptr, smask, t, BKB, KB)
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        # Two steps per pass, so that two values hold the decoded operands: a step's decode runs while the step
        # before's wgmma still reads its register operand. In a rolled loop both are one value, the same registers.
        # A step's scale bytes are loaded two steps ahead: loaded one step ahead, the wait for them was the
        # consumers' largest stall (ncu, H200, sixteenth session).
        for i in range(STEPS // 2):
            sb2 = load_scales(sptr, smask, t, (2 * i + 2) * BKB, KB)
            acc = _release(w_s, a_s, ready, empty, j + 2 * i, i > 0, sb0, acc, RAW, DOT)
            sb3 = load_scales(sptr, smask, t, (2 * i + 3) * BKB, KB)
            acc = _release(w_s, a_s, ready, empty, j + 2 * i + 1, True, sb1, acc, RAW, DOT)
            sb0 = sb2
            sb1 = sb3
        if STEPS % 2 == 1:
            acc = _release(w_s, a_s, ready, empty, j + STEPS - 1, STEPS > 1, sb0, acc, RAW, DOT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((j + STEPS - 1) % STAGES))  # the tile's last slot: the producer runs on
        epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP)


# SWAP by wrapper: Triton 3.6 passes a partition's constexpr arguments as i32 values, so the default partition is one of
# two functions that each call _consume with a literal
@gluon.jit
def _consume_out(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, False)


@gluon.jit
def _consume_swap(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, True)


@gluon.jit
def wgws_kernel(x_desc, y_desc, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, NT, TILES, STEPS, BN: gl.constexpr,
                BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, SWAP: gl.constexpr):
    """acc [BN, BM] = X @ Y.T tiles: X the N rows of NVFP4 words (``x_desc``, block scales ``sx_ptr``), decoded in
    registers; Y the M rows pre-decoded to fp16 (``y_desc``). out [M, N] = acc.T (X the weight), or with SWAP out
    [N, M] = acc (X the activation). The TILES tiles (NT along N) of STEPS K steps each are shared out in order
    (``_first_tile``): a grid of TILES CTAs is the plain tiled kernel, a smaller one persistent (the loads run on
    across tile ends). The default partition (num_warps = BN / 16) consumes, a worker warp loads."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], x_desc.layout)
    a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BKB * 16], y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (w_s, a_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS)
    load = (x_desc, y_desc, w_s, a_s, ready, empty, TILES, NT, STEPS)
    if SWAP:
        gl.warp_specialize([(_consume_swap, args), (_producer, load)], [1], [40])
    else:
        gl.warp_specialize([(_consume_out, args), (_producer, load)], [1], [40])


@functools.lru_cache(maxsize=None)
def layouts(BN: int, BM: int, BKB: int) -> tuple:
    """Shared-memory layouts of a [BN, BKB] tile of words (X) and a [BM, BKB*16] tile of the pre-decoded Y (TMA and
    wgmma). The word tile takes the default for int64: a fixed 128-byte swizzle fails for BKB < 16. Cached: building
    them took ~38 us of host time per call."""
    return (gl.NVMMASharedLayout.get_default_for([BN, BKB], gl.int64),
            gl.NVMMASharedLayout.get_default_for([BM, BKB * 16], gl.float16))
