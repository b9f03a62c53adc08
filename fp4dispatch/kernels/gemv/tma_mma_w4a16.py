"""``w4a16_mm`` for M <= 16 on SM90 in Gluon (``TmaMmaW4A16Config``): ``gemv.tma_warp_specialized``'s TMA ring
feeding ``mma.sync`` m16n8k16 with the operands swapped: the weight is the MMA's A (16 rows per instance), the
activations its B (8 token columns; two instances for M <= 16). Only imported where
:func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

Why not the wgmma register-operand tile's form: at M <= 16 that tile spends about a third of its instructions on
wgmma bookkeeping and the integer scale decode, and needs the activations copied into its K order first (a second
launch). Here the decode goes straight into mma.sync's A fragment, whose K order is free to choose: lane (g, t)
takes, for weight rows g and g+8, the whole blocks 2t and 2t+1 of each 8-block chunk, so all its values of a block
share one scale, and its activation values (B: token g, the same K) are contiguous. Within a block the pairs are
``bf16x2.pair_bf16``'s nibbles (J, J+4) of a word (or ``fp16x2._pair``'s); B's pairs are made from the activations'
natural ones by one ``prmt`` per register. Values are e2m1 * e4m3 * 2**-7 in the activations' dtype (exact), the
products exact in fp32; the epilogue multiplies by 2**7 and alpha.

Ring: per step, the weight as BW/8 TMA boxes [4, R, 8] of int64 words (R rows of each 32-row quarter, 8 blocks: a
lane's 16-byte read and its warp's 8 rows are 512 contiguous bytes, no bank conflicts), the scale box of
``tma_warp_specialized`` and the activations: at K % 64 == 0 as 128-byte lines under the 128-byte swizzle, a box
[rows, 2, 16] of int64 per chunk (one [1, BW/4, 16] per step for one row), so that their reads meet in no bank
(``swizzled_tokens``); else the box of whole rows [rows, BW*4]. The operands' loads and the MMA are
``mma_sync_operands``. Tile rows, in (quarter, row) order, are
rg*16 + 8h + g for MMA row group rg, half h and lane row g; ``k_warps`` warps share a tile's K (the epilogue sums
them). Past N and K the boxes are zero-filled (N % 32, K % 32, as ``tma_warp_specialized``'s).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .. import runtime
from ..config import TmaMmaW4A16Config
from ..gemm.gluon_tiles import first_tile, ring_barriers
from ..runtime import launch, tma_desc
from . import mma_sync_operands as ops
from .tma_warp_specialized import plain, reg_cap

@gluon.jit
def _producer(w_desc, ws_desc, a_desc, w_s, ws_s, a_s, ready, empty, TILES, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring (the weight one 8-block chunk at a time)."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    CH: gl.constexpr = w_s.type.shape[0] // STAGES
    R: gl.constexpr = w_s.type.shape[2]
    SWZ: gl.constexpr = len(a_s.type.shape) == 4
    MB: gl.constexpr = a_s.type.shape[1]  # [STAGES, 1, 2 * CH, 16] with one token row
    NBYTES: gl.constexpr = 4 * R * (8 * CH) * 8 + (8 * CH) * R * 4 + MB * (8 * CH) * 32  # words, scales, acts
    lo = first_tile(gl.program_id(0), TILES)
    for it in range((first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
        tile = lo + it // STEPS
        kw = (it % STEPS) * (8 * CH)
        g = tile // (32 // R)
        i0 = (tile % (32 // R)) * R
        s = it % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        for c in gl.static_range(CH):
            tma.async_copy_global_to_shared(w_desc, [4 * g, i0, kw + 8 * c], ready.index(s), w_s.index(s * CH + c))
        tma.async_copy_global_to_shared(ws_desc, [g, kw // 4, 4 * i0], ready.index(s), ws_s.index(s))
        if SWZ and MB == 1:  # one box [1, 2 * CH, 16]: the slot's lines
            tma.async_copy_global_to_shared(a_desc, [0, kw // 4, 0], ready.index(s), a_s.index(s))
        elif SWZ:  # a box [MB, 2, 16] per chunk (its two 128-byte lines of each token row)
            for c in gl.static_range(CH):
                tma.async_copy_global_to_shared(a_desc, [0, kw // 4 + 2 * c, 0], ready.index(s), a_s.index(s * CH + c))
        else:
            tma.async_copy_global_to_shared(a_desc, [0, kw * 4], ready.index(s), a_s.index(s))


@gluon.jit
def _mma_pairs(a0, a1, a2, a3, q, Q: gl.constexpr, acc, BF16: gl.constexpr):
    """``acc`` + the MMA of A (a0..a3) with B's pairs (k, k + 4) and (k + 1, k + 5): the low and the high halves of
    the activation pairs Q and Q + 2 of ``q``."""
    return ops.mma(a0, a1, a2, a3, ops.prmt(q[Q], q[Q + 2], 0x5410), ops.prmt(q[Q], q[Q + 2], 0x7632), acc, BF16)


@gluon.jit
def _step(w_s, ws_s, a_s, s, acc, acc2, L: gl.constexpr, NT: gl.constexpr, BF16: gl.constexpr):
    """Ring slot s's products added to the accumulators (acc2: tokens 8..15, with NT = 2 token tiles)."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    RG: gl.constexpr = acc[0].type.shape[0]
    KW: gl.constexpr = acc[0].type.shape[2]
    C: gl.constexpr = acc[0].type.shape[3]
    w = w_s._reinterpret(gl.int64, [STAGES, KW, C, RG, 2, 8, 4, 2], plain(7)).index(s).load(
        ops.weight_lanes(C, KW, RG))
    w = gl.permute(w, (2, 4, 0, 1, 5, 6, 3))  # (kw, c, rg, h, g, t, b) -> (rg, g, kw, c, t, b, h)
    w0, w1 = gl.split(w)
    w00, w01 = gl.split(w0)
    w10, w11 = gl.split(w1)
    sc = ops.scales(ws_s, s, RG, KW, C, L, BF16)
    if len(a_s.type.shape) == 4:
        q, q2 = ops.tokens_swizzled(a_s, s, STAGES, RG, KW, C, L)
    else:
        q = ops.tokens(a_s, s, 0, RG, KW, C, L)
        if NT > 1:
            q2 = ops.tokens(a_s, s, 1, RG, KW, C, L)
    for b in gl.static_range(2):
        if b == 0:
            x0 = gl.convert_layout(w00, L)
            x1 = gl.convert_layout(w10, L)
        else:
            x0 = gl.convert_layout(w01, L)
            x1 = gl.convert_layout(w11, L)
        for m in gl.static_range(4):  # the block's MMAs: word m // 2, pairs J, J + 1 with J = 2 * (m % 2)
            if m < 2:
                y0 = x0.to(gl.uint32)
                y1 = x1.to(gl.uint32)
            else:
                y0 = (x0 >> 32).to(gl.uint32)
                y1 = (x1 >> 32).to(gl.uint32)
            a0 = ops.value(y0, 2 * (m % 2), sc[b], BF16)
            a1 = ops.value(y1, 2 * (m % 2), sc[2 + b], BF16)
            a2 = ops.value(y0, 2 * (m % 2) + 1, sc[b], BF16)
            a3 = ops.value(y1, 2 * (m % 2) + 1, sc[2 + b], BF16)
            acc = _mma_pairs(a0, a1, a2, a3, q, 8 * b + 4 * (m // 2) + m % 2, acc, BF16)
            if NT > 1:
                acc2 = _mma_pairs(a0, a1, a2, a3, q2, 8 * b + 4 * (m // 2) + m % 2, acc2, BF16)
    return acc, acc2


@gluon.jit
def _store(acc, h: gl.constexpr, tok: gl.constexpr, n0, M, N, alpha, out_ptr, R: gl.constexpr, L: gl.constexpr):
    """One accumulator ([RG, 8, KW, C, 4]: the instance's c0..c3 are rows g / g + 8, tokens 2t / 2t + 1) summed over
    the warps' K shares and the chunks, into out: tile row rg*16 + 8h + g, token 2t + tok."""
    res = gl.sum(gl.sum(acc, axis=3), axis=2) * (128.0 * alpha)  # [RG, 8, 4]
    L3: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L))
    rg = gl.arange(0, res.shape[0], layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    r = rg * 16 + 8 * h + g
    n = n0 + (r // R) * 32 + r % R
    m = 2 * t + tok
    gl.store(out_ptr + m * N + n, res.to(out_ptr.dtype.element_ty), mask=(n < N) & (m < M))


@gluon.jit
def _consume(w_s, ws_s, a_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES, STEPS, KW: gl.constexpr,
             BF16: gl.constexpr):
    """For each of this CTA's tiles: its rows' products with the activation rows, step by step, then the store."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    C: gl.constexpr = w_s.type.shape[0] // STAGES // KW
    L: gl.constexpr = ops.lanes(R // 4, KW, C)
    MB: gl.constexpr = a_s.type.shape[1]
    NT: gl.constexpr = 2 if MB > 8 else 1  # n8 token tiles: a box of 16 rows has two
    alpha = gl.load(alpha_ptr)
    lo = first_tile(gl.program_id(0), TILES)
    for tile in range(lo, first_tile(gl.program_id(0) + 1, TILES)):
        z = gl.zeros([R // 4, 8, KW, C, 4], gl.float32, L)
        acc = (z, z, z, z)
        acc2 = (z, z, z, z)
        for ks in range(STEPS):
            it = (tile - lo) * STEPS + ks
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc, acc2 = _step(w_s, ws_s, a_s, s, acc, acc2, L, NT, BF16)
            # as in tma_warp_specialized: the next TMA write into the slot must not overtake a read in flight
            fence_async_shared()
            mbarrier.arrive(empty.index(s))
        n0 = (tile // (32 // R)) * 128 + (tile % (32 // R)) * R
        for j in gl.static_range(NT):
            part = acc if j == 0 else acc2
            _store(part[0], 0, 8 * j, n0, M, N, alpha, out_ptr, R, L)
            _store(part[1], 0, 8 * j + 1, n0, M, N, alpha, out_ptr, R, L)
            _store(part[2], 1, 8 * j, n0, M, N, alpha, out_ptr, R, L)
            _store(part[3], 1, 8 * j + 1, n0, M, N, alpha, out_ptr, R, L)


@gluon.jit
def tma_mma_w4a16_kernel(w_desc, ws_desc, a_desc, alpha_ptr, out_ptr, M, N, TILES, STEPS, R: gl.constexpr,
                         BW: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr, KW: gl.constexpr,
                         BF16: gl.constexpr, SWZ: gl.constexpr):
    """out [M, N] (M <= MB) = alpha * A @ W.T over TILES tiles of 4R weight rows, STEPS steps of BW 16-blocks; the
    default partition (R/4 * KW warps) consumes, a worker warp loads. SWZ: the activations arrive as swizzled boxes
    of 2 lines per chunk (``swizzled_tokens``)."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES * (BW // 8), 4, R, 8], w_desc.layout)
    ws_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BW // 4, 4 * R], ws_desc.layout)
    if SWZ and MB == 1:
        a_s = gl.allocate_shared_memory(gl.int64, [STAGES, 1, BW // 4, 16], a_desc.layout)
    elif SWZ:
        a_s = gl.allocate_shared_memory(gl.int64, [STAGES * (BW // 8), MB, 2, 16], a_desc.layout)
    else:
        a_s = gl.allocate_shared_memory(gl.int64, [STAGES, MB, BW * 4], a_desc.layout)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([(_consume, (w_s, ws_s, a_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES, STEPS, KW, BF16)),
                        (_producer, (w_desc, ws_desc, a_desc, w_s, ws_s, a_s, ready, empty, TILES, STEPS))],
                       [1], [40])


def _nv(bits: int, rank: int, swizzle: int = 0) -> gl.NVMMASharedLayout:
    # unswizzled (but the swizzled token boxes): the consumer reads the boxes through reshaped views, which a swizzle
    # would break
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=rank)


def swizzled_tokens(rows: int, k_blocks: int, k: int) -> bool:
    """Whether the activations travel as boxes of 128-byte lines under the 128-byte swizzle (``tokens_swizzled``),
    so that a quarter warp's reads of them meet in no bank (unswizzled: 4 lanes in one bank with 8 or 16 token
    rows, 2 with one): when K % 64 == 0 (whole lines: a line past a row's end would read the next row's values,
    which a zero weight block does not cancel when they are NaN) and each box starts 1024 bytes (the swizzle's
    span) after the last, as TMA needs: a box per chunk of 8 or 16 rows (2 or 4 KB), a box per step of one row
    (k_blocks * 32 bytes)."""
    return k % 64 == 0 and (rows >= 8 or k_blocks % 32 == 0)


def descriptors(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, R: int, BW: int, MB: int) -> tuple:
    """The TMA descriptors of ``tma_mma_w4a16_kernel``: words int64 (N/32, 32, KB) box [4, R, 8]; the scales as
    ``tma_warp_specialized.weight_descriptors``' (box [1, BW/4, 4R]); the activations as int64 [M, K/4] (4 values
    each) box [MB, BW*4], or, with ``swizzled_tokens``, as int64 (M, K/64, 16) box [MB, 2, 16] under the 128-byte
    swizzle."""
    n, k, m = b.shape[0], a.shape[1], a.shape[0]
    kb, cb = k // 16, -(-k // 64)
    acts = (tma_desc(a.data_ptr(), torch.int64, (m, k // 64, 16), (k // 4, 16, 1), (MB, 2 if MB > 1 else BW // 4, 16),
                     _nv(64, 3, 128))
            if swizzled_tokens(MB, BW, k) else
            tma_desc(a.data_ptr(), torch.int64, (m, k // 4), (k // 4, 1), (MB, BW * 4), _nv(64, 2)))
    return (tma_desc(b.data_ptr(), torch.int64, (n // 32, 32, kb), (32 * kb, kb, 1), (4, R, 8), _nv(64, 3)),
            tma_desc(sb.data_ptr(), torch.int32, (sb.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1),
                     (1, BW // 4, 4 * R), _nv(32, 3)), acts)


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: TmaMmaW4A16Config) -> None:
    """Launch ``tma_mma_w4a16_kernel`` after the checks its TMA boxes need: a persistent grid of ``ctas_per_sm`` CTAs
    per SM sharing out the tiles."""
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    if m > cfg.rows or n % 32 or k % 32 or any(t.data_ptr() % 16 for t in (a, b, sb)):
        raise ValueError(f"w4a16_mm: {type(cfg).__name__} needs M <= rows, N % 32 == 0, K % 32 == 0 and 16-byte "
                         f"aligned a, b and b_scale; got M={m}, rows={cfg.rows}, N={n}, K={k}, data_ptr() % 16 of "
                         f"(a, b, b_scale) = {tuple(t.data_ptr() % 16 for t in (a, b, sb))}. Use another config "
                         f"from w4a16_configs_for()")
    r, bw = cfg.rows_per_quarter, cfg.k_blocks
    tiles, steps = -(-n // 128) * (32 // r), -(-(k // 16) // bw)
    launch(tma_mma_w4a16_kernel, (min(tiles, runtime.num_sms(out.device) * cfg.ctas_per_sm),),
           *descriptors(a, b, sb, r, bw, cfg.rows), alpha, out, m, n, tiles, steps, R=r, BW=bw, MB=cfg.rows,
           STAGES=cfg.stages, KW=cfg.k_warps, BF16=a.dtype == torch.bfloat16, SWZ=swizzled_tokens(cfg.rows, bw, k),
           num_warps=cfg.warps,
           **reg_cap(cfg.warps, cfg.ctas_per_sm))
