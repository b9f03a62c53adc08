"""Gluon building blocks shared by the SM90 Gluon kernels (``wgmma_warp_specialized``, ``wgmma_decode_warps``,
``gemv.tma_warp_specialized``): register and shared-memory layouts, the weight decode straight into the wgmma register
operand, scale addressing, the static share of tiles per CTA, and the epilogue. Only imported where
:func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_wait  # Triton >= 3.4, as Gluon 3.6 itself

from ..numerics.e2m1_e4m3 import swz_row as _swz_row
from . import wgmma_register_a as _register_a

# the decode and the scale addressing are wmma's own: Gluon compiles a @triton.jit function's body with its semantics
dec16 = gluon.jit(_register_a._dec16.fn)
_scale_cols = gluon.jit(_register_a._scale_cols.fn)
swz_row = gluon.jit(_swz_row.fn)


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
    return sb_ptr + swz_row(rn, CB)[:, None] + _scale_cols(t)[None, :], (rn < N)[:, None], t


@gluon.jit
def load_scales(sptr, smask, t, kb0, KB):
    """Scale bytes of the step that starts at block kb0 (a multiple of 4); 0 past K, whatever the padding holds."""
    return gl.load(sptr + (kb0 // 4) * 512, mask=smask & (kb0 + t < KB)[None, :], other=0)


@gluon.jit
def mma_step(w_s, a_s, ready, it, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr, W4A16: gl.constexpr = False):
    """Step ``it`` of the ring: wait for its slot, decode the weight words (scales ``sb``) straight into the wgmma
    register operand and issue the async wgmma with the slot's A tile. The decode: through the e4m3x2 conversion
    (fp16, NVFP4 activations pre-decoded the same way), or with W4A16 without it, in ``a_s``'s dtype (the 16-bit
    activations in the decode's K order)."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BKB: gl.constexpr = w_s.type.shape[2]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    if W4A16:
        w = dec16(w_s.index(s).load(RAW), sb, BKB, True, False, a_s.dtype == gl.bfloat16)
    else:
        w = dec16(w_s.index(s).load(RAW), sb, BKB, True, True)
    w = gl.convert_layout(w, DOT, assert_trivial=True)
    return warpgroup_mma(w, a_s.index(s).permute((1, 0)), acc, is_async=True)


@gluon.jit
def ring_barriers(n: gl.constexpr):
    """The ready and empty barriers of a ring of n slots (one arrival each: the producer's expect, the consumer's
    release)."""
    ready = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def first_tile(c, TILES):
    """The first of CTA c's tiles: TILES are shared out in order, TILES // grid per CTA and one more to the first
    TILES % grid (a grid of TILES CTAs: one each)."""
    return c * (TILES // gl.num_programs(0)) + gl.minimum(c, TILES % gl.num_programs(0))


@gluon.jit
def tile_offsets(n0, m0, M, N, BN: gl.constexpr, BM: gl.constexpr, L: gl.constexpr, SWAP: gl.constexpr,
                  QR: gl.constexpr = 0, R0: gl.constexpr = 0):
    """(int64 offset of the tile's first row, int32 offsets from it, mask) of the [BN, BM] tile at (n0, m0) of out
    [M, N] (acc.T), or with SWAP of out [N, M] (acc), in layout L: int32 offsets need half the registers of int64
    ones. With QR, the tile's rows are QR rows of each 32-row quarter from n0 (``wgmma_decode_warps``), else BN rows.
    R0: the rows are rows R0.. of a larger tile (a chunk of it)."""
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
def epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP: gl.constexpr, QR: gl.constexpr = 0,
             UNDO: gl.constexpr = 0.25):
    """Apply alpha in fp32 and write the finished tile (wgmma done) through ``store_layout`` (QR: ``tile_offsets``).
    UNDO: the power of two that the operands' decode put in (2**-2 undoes the CVT decode's factor 2 on each NVFP4
    operand; a W4A16 weight decoded without CVT carries 2**-7, undone by 2**7)."""
    ST: gl.constexpr = store_layout(acc.type.shape[0], acc.type.shape[1], SWAP, gl.num_warps())
    corner, offs, mask = tile_offsets(n0, m0, M, N, acc.type.shape[0], acc.type.shape[1], ST, SWAP, QR)
    acc = acc * (UNDO * gl.load(alpha_ptr))
    gl.store(out_ptr + corner + offs, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), ST), mask=mask)



@functools.lru_cache(maxsize=None)
def word_tile_layout(BN: int, BKB: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [BN, BKB] tile of weight words (int64), as TMA writes it: the default for int64
    (a fixed 128-byte swizzle fails for BKB < 16). Cached: building it costs more host time than the rest of a small
    call."""
    return gl.NVMMASharedLayout.get_default_for([BN, BKB], gl.int64)


@functools.lru_cache(maxsize=None)
def operand_layout(BM: int, BKB: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [BM, BKB*16] tile of a 16-bit operand (``dtype``: torch.float16 or bfloat16), as
    TMA writes it and wgmma reads it; cached like :func:`word_tile_layout`."""
    return gl.NVMMASharedLayout.get_default_for([BM, BKB * 16], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
