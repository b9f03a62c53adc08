"""``gvws``: the warp-specialized NVFP4 GEMV for SM90 in Gluon (``TmaGemvConfig``, M <= 2). Only imported where
:func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

``gemv.cuda_core`` streams the weight with plain loads, so the bytes in flight are bounded by the registers of the
warps that fit an SM. Here a producer warp streams everything by TMA into a STAGES-deep shared-memory ring, so the
bytes in flight no longer depend on registers, and the consumer warps only read shared memory, decode and multiply:
with ``int8_dot`` each 16-block's sum is an exact int32 of ``dp4a`` on codes looked up as 2 * e2m1
(``numerics.int8_dot``), else fp16x2 products through the e4m3x2 conversion (``numerics.fp16x2``). The feed and the
consumers each take about as long as the whole kernel, so both bound it.

Rows are taken the way the scales are stored. In the 128x4 swizzle, the scales of row ``g*128 + q*32 + i`` and
blocks ``4j..4j+3`` are the 4 bytes at ``(g*CB + j)*512 + i*16 + q*4``: 16 contiguous bytes hold one ``i`` of all
four ``q``. TMA needs 16-byte rows, so a tile is R rows ``i0..i0+R`` of each of the four 32-row quarters ``q`` of a
128-row group (BN = 4R rows), and every operand arrives as one box per step:

- weight words (``b`` as int64 [N/32, 32, KB]): box [4, R, BW] -> read as [4, R, BW/4, 4] (q, i, j, b);
- weight scales (int32 view (g, j, 4i + q) of the swizzled bytes): box [1, BW/4, 4R] -> bytes (j, i, q, b), read
  permuted to (q, i, j, b), so each thread's scale bytes sit beside its words;
- activation words [MB, BW] and scales (the same view, i < MB, q = 0 used).

Each consumer step ends with a proxy fence before it frees its slot: without it the producer's next TMA write can
overtake reads still in flight.

Past N and K the boxes are zero-filled; that is why N % 32 == 0 (a box must not run past a quarter into the next
group's rows) and K % 32 == 0 (16-byte rows). A CTA runs a range of whole tiles (``gluon_tiles.first_tile``), so the
producer streams on across tile ends.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .. import runtime
from ..config import TmaGemvConfig
from ..gemm.gluon_tiles import first_tile, ring_barriers
from ..numerics import fp16x2 as _h2, int8_dot as _dp4
from ..runtime import launch, tma_desc

_block = gluon.jit(_h2.h2_block_cvt.fn)
_act_i8 = gluon.jit(_dp4.act_i8.fn)
_dp_block = gluon.jit(_dp4.dp_block.fn)
_dp4_table = gluon.jit(_dp4.table.fn)


@gluon.jit
def _e4m3(u8):
    """Scale bytes -> fp32 through the hardware e4m3x2 -> f16x2 conversion (a thread's two adjacent bytes in one
    instruction; exact, NaN kept): fewer instructions per 16-block than ``numerics.e2m1_e4m3.e4m3_to_f32``'s integer
    decode."""
    return u8.to(gl.float8e4nv, bitcast=True).to(gl.float32)


@triton.constexpr_function
def word_layout(bw: int, warps: int) -> gl.BlockedLayout:
    """[4, R, BW/4, 4] words (q, i, j, b): each thread 2 words (16 bytes) of a row, BW/2 threads a row of a step,
    64/BW rows per warp; warps along q (then i), so a thread's activation words serve 4R * BW / (64 * warps) rows."""
    bw, warps = (getattr(v, "value", v) for v in (bw, warps))
    wq = min(warps, 4)
    return gl.BlockedLayout(size_per_thread=[1, 1, 1, 2], threads_per_warp=[1, 64 // bw, bw // 4, 2],
                            warps_per_cta=[wq, warps // wq, 1, 1], order=[3, 2, 1, 0])


@triton.constexpr_function
def plain(rank: int) -> gl.SwizzledSharedLayout:
    """Row-major shared memory, no swizzle: how the unswizzled TMA boxes lie, so any reshape of them is a view."""
    rank = getattr(rank, "value", rank)
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=list(range(rank - 1, -1, -1)))


@gluon.jit
def _producer(w_desc, ws_desc, a_desc, as_desc, w_s, ws_s, a_s, as_s, ready, empty, TILES, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    BW: gl.constexpr = w_s.type.shape[3]
    MB: gl.constexpr = a_s.type.shape[1]
    NBYTES: gl.constexpr = 4 * R * BW * 8 + R * BW * 4 + MB * BW * 8 + MB * BW * 4
    lo = first_tile(gl.program_id(0), TILES)
    for it in range((first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
        tile = lo + it // STEPS
        kw = (it % STEPS) * BW
        g = tile // (32 // R)
        i0 = (tile % (32 // R)) * R
        s = it % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        tma.async_copy_global_to_shared(w_desc, [4 * g, i0, kw], ready.index(s), w_s.index(s))
        tma.async_copy_global_to_shared(ws_desc, [g, kw // 4, 4 * i0], ready.index(s), ws_s.index(s))
        tma.async_copy_global_to_shared(a_desc, [0, kw], ready.index(s), a_s.index(s))
        tma.async_copy_global_to_shared(as_desc, [0, kw // 4, 0], ready.index(s), as_s.index(s))


@gluon.jit
def _act(a_s, as_s, s, m, q, L: gl.constexpr):
    """Activation row m of ring slot s: its words as (lo, hi) uint32 [BW/4, 4] and its block scales (fp32) in L, the
    layout that broadcasts against the weight's. The scale box holds the rows' bytes of all four quarters; q: the
    rows' quarter (0 here; the grouped kernel's chunks may start in any: a runtime value, uniform per tile)."""
    STAGES: gl.constexpr = a_s.type.shape[0]
    MB: gl.constexpr = a_s.type.shape[1]
    BW: gl.constexpr = a_s.type.shape[2]
    x = a_s._reinterpret(gl.int64, [STAGES * MB, BW // 4, 4], plain(2)).index(s * MB + m).load(L)
    raw = as_s._reinterpret(gl.uint8, [STAGES, BW // 4, MB * 16], plain(2)).index(s)  # (j, m, q, b)
    if q == 0:
        sa = raw.slice(16 * m, 4, dim=1).load(L)
    elif q == 1:
        sa = raw.slice(16 * m + 4, 4, dim=1).load(L)
    elif q == 2:
        sa = raw.slice(16 * m + 8, 4, dim=1).load(L)
    else:
        sa = raw.slice(16 * m + 12, 4, dim=1).load(L)
    return x.to(gl.uint32), (x >> 32).to(gl.uint32), _e4m3(sa)


@gluon.jit
def _sum(b_lo, b_hi, a_lo, a_hi, tbl, DP: gl.constexpr):
    """Each 16-block's sum of products of the weight words with one activation row's, as fp32 times ``_undo(DP)``:
    exact either way (``_dp4`` int8 dot products with DP, else ``_h2``'s fp16 pairs)."""
    if DP:
        a0, a1 = _act_i8(a_lo, tbl[0], tbl[1])
        a2, a3 = _act_i8(a_hi, tbl[0], tbl[1])
        return _dp_block(b_lo, b_hi, a0[None, None], a1[None, None], a2[None, None], a3[None, None], tbl[0],
                         tbl[1]).to(gl.float32)
    else:
        return _block(b_lo, b_hi, a_lo[None, None], a_hi[None, None])


@triton.constexpr_function
def _undo(dp) -> float:
    """What the block sums of ``_sum`` are multiplied by to give w * a."""
    return _dp4.DP_UNDO.value if getattr(dp, "value", dp) else _h2.H2_UNDO_CVT.value


@gluon.jit
def _step(w_s, ws_s, a_s, as_s, ready, empty, it, acc0, acc1, tbl, LW: gl.constexpr, DP: gl.constexpr, q=0,
          ROW1: gl.constexpr = True):
    """Ring step ``it``: wait for its slot, add this step's products to the accumulators, free the slot (q: the
    activation rows' quarter, ``_act``; ROW1 False: the slot's second row is not needed, acc1 is left as it is)."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    BW: gl.constexpr = w_s.type.shape[3]
    MB: gl.constexpr = a_s.type.shape[1]
    LA: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LW))  # x[None, None] expands at 0, then 1
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    # (views of the whole ring: Triton 3.6 reinterprets only a buffer, not a slot of it)
    w = w_s._reinterpret(gl.int64, [STAGES, 4, R, BW // 4, 4], plain(4)).index(s).load(LW)
    sw = ws_s._reinterpret(gl.uint8, [STAGES, BW // 4, R, 4, 4], plain(4)).index(s).permute((2, 1, 0, 3)).load(LW)
    a_lo, a_hi, sa = _act(a_s, as_s, s, 0, q, LA)
    if MB > 1 and ROW1:
        a1_lo, a1_hi, sa1 = _act(a_s, as_s, s, 1, q, LA)
    b_lo = w.to(gl.uint32)
    b_hi = (w >> 32).to(gl.uint32)
    sb = _e4m3(sw)
    acc0 += _sum(b_lo, b_hi, a_lo, a_hi, tbl, DP) * (sb * sa[None, None])
    if MB > 1 and ROW1:
        acc1 += _sum(b_lo, b_hi, a1_lo, a1_hi, tbl, DP) * (sb * sa1[None, None])
    # The producer's next TMA write into the slot must not overtake a read of it still in flight. Nothing in the
    # program orders them: ptxas leaves uses of loaded values (and so the loads' completion) after the arrive, and
    # the barrier inside the arrive orders the generic proxy only. With 2-3 CTAs per SM that race gives wrong sums;
    # the proxy fence waits for the reads.
    fence_async_shared()
    mbarrier.arrive(empty.index(s))
    return acc0, acc1


@gluon.jit
def _store(acc, m, n0, M, N, alpha, out_ptr, LW: gl.constexpr, UNDO: gl.constexpr):
    """Row m of out, columns n0 + q*32 + i: the sum over the tile's blocks, undone and times alpha."""
    R: gl.constexpr = acc.type.shape[1]
    res = gl.sum(gl.sum(acc, axis=3), axis=2) * (UNDO * alpha)
    L2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LW))
    n = n0 + gl.arange(0, 4, layout=gl.SliceLayout(1, L2))[:, None] * 32 + \
        gl.arange(0, R, layout=gl.SliceLayout(0, L2))[None, :]
    gl.store(out_ptr + m * N + n, res.to(out_ptr.dtype.element_ty), mask=(n < N) & (m < M))


@gluon.jit
def _consume(w_s, ws_s, a_s, as_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES, STEPS, DP: gl.constexpr):
    """For each of this CTA's tiles: the dot products of its 4R rows with the activation row(s), then the store."""
    R: gl.constexpr = w_s.type.shape[2]
    BW: gl.constexpr = w_s.type.shape[3]
    MB: gl.constexpr = a_s.type.shape[1]
    LW: gl.constexpr = word_layout(BW, gl.num_warps())
    alpha = gl.load(alpha_ptr)
    tbl = _dp4_table(N)  # (from N: a launch makes M = 1 a constant, and ptxas would fold the table again)
    lo = first_tile(gl.program_id(0), TILES)
    for tile in range(lo, first_tile(gl.program_id(0) + 1, TILES)):
        acc0 = gl.zeros([4, R, BW // 4, 4], gl.float32, LW)
        acc1 = acc0
        for ks in range(STEPS):
            acc0, acc1 = _step(w_s, ws_s, a_s, as_s, ready, empty, (tile - lo) * STEPS + ks, acc0, acc1, tbl,
                               LW, DP)
        n0 = (tile // (32 // R)) * 128 + (tile % (32 // R)) * R
        _store(acc0, 0, n0, M, N, alpha, out_ptr, LW, _undo(DP))
        if MB > 1:
            _store(acc1, 1, n0, M, N, alpha, out_ptr, LW, _undo(DP))


@gluon.jit
def ring(w_desc, ws_desc, a_desc, as_desc, R: gl.constexpr, BW: gl.constexpr, MB: gl.constexpr,
         STAGES: gl.constexpr):
    """The STAGES-deep shared-memory ring of the four TMA boxes, with its ready and empty barriers."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, 4, R, BW], w_desc.layout)
    ws_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BW // 4, 4 * R], ws_desc.layout)
    a_s = gl.allocate_shared_memory(gl.int64, [STAGES, MB, BW], a_desc.layout)
    as_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BW // 4, 4 * MB], as_desc.layout)
    ready, empty = ring_barriers(STAGES)
    return w_s, ws_s, a_s, as_s, ready, empty


@gluon.jit
def gvws_kernel(w_desc, ws_desc, a_desc, as_desc, alpha_ptr, out_ptr, M, N, TILES, STEPS, R: gl.constexpr,
                BW: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr, DP: gl.constexpr = False):
    """out [M, N] (M <= MB) = alpha * A @ W.T over TILES tiles of 4R weight rows, STEPS steps of BW 16-blocks each
    (the views: ``descriptors``); the default partition (num_warps) consumes, a worker warp loads. DP: the products
    by ``_dp4``'s int8 dot products (else ``_h2``'s fp16 pairs)."""
    w_s, ws_s, a_s, as_s, ready, empty = ring(w_desc, ws_desc, a_desc, as_desc, R, BW, MB, STAGES)
    gl.warp_specialize([(_consume, (w_s, ws_s, a_s, as_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES, STEPS, DP)),
                        (_producer, (w_desc, ws_desc, a_desc, as_desc, w_s, ws_s, a_s, as_s, ready, empty, TILES,
                                     STEPS))], [1], [40])


@functools.cache
def _layouts() -> tuple:
    # unswizzled: the consumer reads the boxes through reshaped views, which a swizzle would break
    def nv(bits: int, rank: int) -> gl.NVMMASharedLayout:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=rank)
    return nv(64, 3), nv(32, 3), nv(64, 2), nv(32, 3)


def weight_descriptors(b: torch.Tensor, sb: torch.Tensor, R: int, BW: int) -> tuple:
    """The TMA descriptors (cached: ``runtime.tma_desc``) of a tile of R rows of each 32-row quarter and BW 16-blocks,
    over contiguous canonical operands (uint8 words, swizzled scale bytes; N % 32 == 0, K % 32 == 0, 16-byte aligned:
    the caller checks); also ``gemm.wgmma_decode_warps``'s:
    - words: int64 (N/32, 32, KB), box [4, R, BW];
    - scales: int32 (g, j, 4i + q), the 4 bytes of row g*128 + q*32 + i and blocks 4j..4j+3, so a box of consecutive
      i is one contiguous run of 16 bytes per i; box [1, BW/4, 4R]."""
    n, kb = b.shape[0], b.shape[1] // 8
    cb = -(-kb // 4)
    wl, wsl, _, _ = _layouts()
    return (tma_desc(b.data_ptr(), torch.int64, (n // 32, 32, kb), (32 * kb, kb, 1), (4, R, BW), wl),
            tma_desc(sb.data_ptr(), torch.int32, (sb.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1),
                     (1, BW // 4, 4 * R), wsl))


def descriptors(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, R: int, BW: int,
                MB: int) -> tuple:
    """The four TMA descriptors of ``gvws_kernel``: the weight's (``weight_descriptors``), then the activation's words
    as int64 [M, KB] and its scales viewed as the weight's."""
    kb, m = a.shape[1] // 8, a.shape[0]
    cb = -(-kb // 4)
    _, _, al, asl = _layouts()
    return (*weight_descriptors(b, sb, R, BW),
            tma_desc(a.data_ptr(), torch.int64, (m, kb), (kb, 1), (MB, BW), al),
            tma_desc(sa.data_ptr(), torch.int32, (sa.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1),
                     (1, BW // 4, 4 * MB), asl))


def work(n: int, kb: int, r: int, bw: int) -> tuple[int, int]:
    """(tiles, steps per tile) of ``gvws_kernel`` over N = n rows and kb 16-blocks per row."""
    return -(-n // 128) * (32 // r), -(-kb // bw)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: TmaGemvConfig) -> None:
    """Launch ``gvws_kernel`` after the checks its TMA boxes need: a persistent grid of ``ctas_per_sm`` CTAs per SM
    sharing out the tiles."""
    m, n, kb = a.shape[0], b.shape[0], a.shape[1] // 8
    if m > cfg.rows or n % 32 or kb % 2 or any(t.data_ptr() % 16 for t in (a, b, sa, sb)):
        raise ValueError(f"fp4_mm: {type(cfg).__name__} needs M <= rows, N % 32 == 0, K % 32 == 0 and 16-byte aligned "
                         f"operands; got M={m}, rows={cfg.rows}, N={n}, K={kb * 16}, data_ptr() % 16 of (a, b, "
                         f"a_scale, b_scale) = {tuple(t.data_ptr() % 16 for t in (a, b, sa, sb))}. Use another "
                         f"config from configs_for()")
    r, bw, mb, warps, per_sm = cfg.rows_per_quarter, cfg.k_blocks, cfg.rows, cfg.warps, cfg.ctas_per_sm
    tiles, steps = work(n, kb, r, bw)
    launch(gvws_kernel, (min(tiles, runtime.num_sms(out.device) * per_sm),), *descriptors(a, b, sa, sb, r, bw, mb),
           alpha, out, m, n, tiles, steps, R=r, BW=bw, MB=mb, STAGES=cfg.stages, DP=cfg.int8_dot, num_warps=warps,
           **reg_cap(warps, per_sm))


def reg_cap(warps: int, per_sm: int) -> dict:
    """The compile option that lets ``per_sm`` CTAs of ``warps`` consumer warps (and the producer's warpgroup) fit an
    SM: Triton sizes a warp-specialized kernel's registers for one CTA per SM. More warps per SM hide the consumers'
    latency."""
    return {"maxnreg": 65536 // (per_sm * (warps + 4) * 32) // 8 * 8} if per_sm > 1 else {}
