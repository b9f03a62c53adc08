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
``tma_warp_specialized`` and the activation box [rows, BW*16]. Tile rows, in (quarter, row) order, are
rg*16 + 8h + g for MMA row group rg, half h and lane row g; ``k_warps`` warps share a tile's K (the epilogue sums
them). Past N and K the boxes are zero-filled (N % 32, K % 32, as ``tma_warp_specialized``'s).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .. import runtime
from ..config import TmaMmaW4A16Config
from ..gemm.gluon_tiles import first_tile, ring_barriers
from ..numerics import bf16x2 as _b2, fp16x2 as _h2
from ..runtime import launch, tma_desc
from .tma_warp_specialized import _e4m3, plain, reg_cap

_pair_bf16 = gluon.jit(_b2.pair_bf16.fn)
_pair_f16 = gluon.jit(_h2._pair.fn)
TWO_119 = gl.constexpr(6.646139978924579e35)  # bf16: folds the placement's 2**-126 into the scale, leaving 2**-7
TWO_7 = gl.constexpr(128.0)  # fp16: the placement's 2**-14 times scale * 2**7 leaves 2**-7
_MMA_BF16 = gl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
                         "{$10,$11,$12,$13};")
_MMA_F16 = gl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
                        "{$10,$11,$12,$13};")


@gluon.jit
def _scale(u8, BF16: gl.constexpr):
    """e4m3 bytes -> the pair multiplier with the scale in both halves: bf16x2 of scale * 2**119 or fp16x2 of
    scale * 2**7 (exact; a NaN scale stays NaN)."""
    if BF16:
        h = (_e4m3(u8) * TWO_119).to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    else:
        h = (_e4m3(u8) * TWO_7).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
    return h | (h << 16)


@gluon.jit
def _value(w, J: gl.constexpr, sc, BF16: gl.constexpr):
    """Nibbles J, J+4 of the words times their block scale: exact pairs of e2m1 * e4m3 * 2**-7 (for bf16 the -0.0
    addend keeps a zero product's sign, as ``bf16x2.scaled_bf16``)."""
    if BF16:
        return gl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
                                         "=r,r,r", [_pair_bf16(w, J), sc], dtype=gl.uint32, is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [_pair_f16(w, J), sc],
                                         dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _prmt(a, b, SEL: gl.constexpr):
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _mma(a0, a1, a2, a3, b0, b1, acc, BF16: gl.constexpr):
    """acc (4 fp32 tensors: the instance's c0..c3) + A @ B of one m16n8k16 per element."""
    return gl.inline_asm_elementwise(_MMA_BF16 if BF16 else _MMA_F16, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
                                     [a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3]],
                                     dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)


@triton.constexpr_function
def lanes(rg: int, kw: int, c: int) -> gl.BlockedLayout:
    """[RG, 8 (g), KW, C, 4 (t)]: one MMA instance per (rg, kw, c) in each lane (lane = 4g + t, as mma.sync's
    fragments), the C chunks of a warp's K share in registers; warp = kw + KW * rg."""
    rg, kw, c = (getattr(v, "value", v) for v in (rg, kw, c))
    return gl.BlockedLayout(size_per_thread=[1, 1, 1, c, 1], threads_per_warp=[1, 8, 1, 1, 4],
                            warps_per_cta=[rg, 1, kw, 1, 1], order=[4, 3, 2, 1, 0])


@gluon.jit
def _producer(w_desc, ws_desc, a_desc, w_s, ws_s, a_s, ready, empty, TILES, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring (the weight one 8-block chunk at a time)."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    CH: gl.constexpr = w_s.type.shape[0] // STAGES
    R: gl.constexpr = w_s.type.shape[2]
    MB: gl.constexpr = a_s.type.shape[1]
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
        tma.async_copy_global_to_shared(a_desc, [0, kw * 4], ready.index(s), a_s.index(s))


@gluon.jit
def _b(x, LA: gl.constexpr, zero):
    """[8, KW, C, 4] -> [RG, 8, KW, C, 4] uint32 (the same for every row group)."""
    return (gl.expand_dims(gl.convert_layout(x, LA), 0) + zero).to(gl.uint32, bitcast=True)


@gluon.jit
def _tokens(a_s, s, half: gl.constexpr, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """Slot s's activation pairs of tokens 8*half + g (rows 1: token 0 in every lane, a broadcast read): 16 uint32
    tensors in L, Q = 0..7 of block 2t then 0..7 of block 2t + 1 (Q: the pair of k = 2Q, 2Q + 1)."""
    STAGES: gl.constexpr = a_s.type.shape[0]
    MB: gl.constexpr = a_s.type.shape[1]
    NB: gl.constexpr = 8 if MB > 1 else 1
    LQ: gl.constexpr = gl.BlockedLayout([1, 1, C, 1, 16], [8, 1, 1, 4, 1], [RG, KW, 1, 1, 1], [4, 2, 3, 1, 0])
    q = a_s._reinterpret(gl.int32, [STAGES * MB // NB, NB, KW, C, 4, 16], plain(5)).index(
        s * (MB // NB) + half).load(LQ)
    q = gl.reshape(q, [NB, KW, C, 4, 2, 2, 2, 2])  # (.., block, Q // 4, Q // 2 % 2, Q % 2)
    zero = gl.zeros([RG, 8, KW, C, 4], gl.int32, L)
    LA: gl.constexpr = gl.SliceLayout(0, L)
    x0, x1 = gl.split(q)
    x00, x01 = gl.split(x0)
    x10, x11 = gl.split(x1)
    x000, x001 = gl.split(x00)
    x010, x011 = gl.split(x01)
    x100, x101 = gl.split(x10)
    x110, x111 = gl.split(x11)
    # x{Q % 2}{Q // 2 % 2}{Q // 4}, each [.., block]
    q0, q8 = gl.split(x000)
    q1, q9 = gl.split(x100)
    q2, q10 = gl.split(x010)
    q3, q11 = gl.split(x110)
    q4, q12 = gl.split(x001)
    q5, q13 = gl.split(x101)
    q6, q14 = gl.split(x011)
    q7, q15 = gl.split(x111)
    return (_b(q0, LA, zero), _b(q1, LA, zero), _b(q2, LA, zero), _b(q3, LA, zero), _b(q4, LA, zero),
            _b(q5, LA, zero), _b(q6, LA, zero), _b(q7, LA, zero), _b(q8, LA, zero), _b(q9, LA, zero),
            _b(q10, LA, zero), _b(q11, LA, zero), _b(q12, LA, zero), _b(q13, LA, zero), _b(q14, LA, zero),
            _b(q15, LA, zero))


@gluon.jit
def _scales(ws_s, s, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr, BF16: gl.constexpr):
    """Slot s's scale multipliers (``_scale``) of (row half h, block 2t + b): (h0 b0, h0 b1, h1 b0, h1 b1) in L. The
    box's bytes are (j, i, q, bb): j = 2 * chunk + t // 2, bb = 2 * (t % 2) + b; R 16: i = 8h + g, q = rg; R 8:
    i = g, q = 2 rg + h."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    R: gl.constexpr = ws_s.type.shape[3] // 4
    if R == 16:
        LS: gl.constexpr = gl.BlockedLayout([1, C, 1, 2, 1, 1, 1, 2], [1, 1, 2, 1, 8, 1, 2, 1],
                                            [KW, 1, 1, 1, 1, RG, 1, 1], [7, 3, 1, 6, 2, 4, 0, 5])
        v = ws_s._reinterpret(gl.uint8, [STAGES, KW, C, 2, 2, 8, RG, 2, 2], plain(8)).index(s).load(LS)
        v = gl.permute(v, (5, 4, 0, 1, 2, 6, 3, 7))  # (kw, c, t_hi, h, g, rg, t_lo, b) -> (rg, g, kw, c, t.., h, b)
    else:
        LS: gl.constexpr = gl.BlockedLayout([1, C, 1, 1, 1, 2, 1, 2], [1, 1, 2, 8, 1, 1, 2, 1],
                                            [KW, 1, 1, 1, RG, 1, 1, 1], [7, 5, 1, 6, 2, 3, 0, 4])
        v = ws_s._reinterpret(gl.uint8, [STAGES, KW, C, 2, 8, RG, 2, 2, 2], plain(8)).index(s).load(LS)
        v = gl.permute(v, (4, 3, 0, 1, 2, 6, 5, 7))  # (kw, c, t_hi, g, rg, h, t_lo, b) -> (rg, g, kw, c, t.., h, b)
    v = gl.reshape(v, [RG, 8, KW, C, 4, 2, 2])
    h0, h1 = gl.split(gl.permute(v, (0, 1, 2, 3, 4, 6, 5)))
    h0b0, h0b1 = gl.split(h0)
    h1b0, h1b1 = gl.split(h1)
    return (_scale(gl.convert_layout(h0b0, L), BF16), _scale(gl.convert_layout(h0b1, L), BF16),
            _scale(gl.convert_layout(h1b0, L), BF16), _scale(gl.convert_layout(h1b1, L), BF16))


@gluon.jit
def _step(w_s, ws_s, a_s, s, acc, acc2, L: gl.constexpr, NT: gl.constexpr, BF16: gl.constexpr):
    """Ring slot s's products added to the accumulators (acc2: tokens 8..15, with NT = 2 token tiles)."""
    STAGES: gl.constexpr = ws_s.type.shape[0]
    RG: gl.constexpr = acc[0].type.shape[0]
    KW: gl.constexpr = acc[0].type.shape[2]
    C: gl.constexpr = acc[0].type.shape[3]
    LW: gl.constexpr = gl.BlockedLayout([1, C, 1, 2, 1, 1, 2], [1, 1, 1, 1, 8, 4, 1], [KW, 1, RG, 1, 1, 1, 1],
                                        [6, 3, 1, 5, 4, 0, 2])
    w = w_s._reinterpret(gl.int64, [STAGES, KW, C, RG, 2, 8, 4, 2], plain(7)).index(s).load(LW)
    w = gl.permute(w, (2, 4, 0, 1, 5, 6, 3))  # (kw, c, rg, h, g, t, b) -> (rg, g, kw, c, t, b, h)
    w0, w1 = gl.split(w)
    w00, w01 = gl.split(w0)
    w10, w11 = gl.split(w1)
    sc = _scales(ws_s, s, RG, KW, C, L, BF16)
    q = _tokens(a_s, s, 0, RG, KW, C, L)
    if NT > 1:
        q2 = _tokens(a_s, s, 1, RG, KW, C, L)
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
            a0 = _value(y0, 2 * (m % 2), sc[b], BF16)
            a1 = _value(y1, 2 * (m % 2), sc[2 + b], BF16)
            a2 = _value(y0, 2 * (m % 2) + 1, sc[b], BF16)
            a3 = _value(y1, 2 * (m % 2) + 1, sc[2 + b], BF16)
            # B pairs (k, k + 4) and (k + 1, k + 5): low and high halves of the activation pairs Q and Q + 2
            acc = _mma(a0, a1, a2, a3, _prmt(q[8 * b + 4 * (m // 2) + m % 2], q[8 * b + 4 * (m // 2) + m % 2 + 2],
                                             0x5410),
                       _prmt(q[8 * b + 4 * (m // 2) + m % 2], q[8 * b + 4 * (m // 2) + m % 2 + 2], 0x7632), acc,
                       BF16)
            if NT > 1:
                acc2 = _mma(a0, a1, a2, a3,
                            _prmt(q2[8 * b + 4 * (m // 2) + m % 2], q2[8 * b + 4 * (m // 2) + m % 2 + 2], 0x5410),
                            _prmt(q2[8 * b + 4 * (m // 2) + m % 2], q2[8 * b + 4 * (m // 2) + m % 2 + 2], 0x7632),
                            acc2, BF16)
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
    L: gl.constexpr = lanes(R // 4, KW, C)
    NT: gl.constexpr = 2 if a_s.type.shape[1] > 8 else 1  # n8 token tiles: a box of 16 rows has two
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
                         BF16: gl.constexpr):
    """out [M, N] (M <= MB) = alpha * A @ W.T over TILES tiles of 4R weight rows, STEPS steps of BW 16-blocks; the
    default partition (R/4 * KW warps) consumes, a worker warp loads."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES * (BW // 8), 4, R, 8], w_desc.layout)
    ws_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BW // 4, 4 * R], ws_desc.layout)
    a_s = gl.allocate_shared_memory(gl.int64, [STAGES, MB, BW * 4], a_desc.layout)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([(_consume, (w_s, ws_s, a_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES, STEPS, KW, BF16)),
                        (_producer, (w_desc, ws_desc, a_desc, w_s, ws_s, a_s, ready, empty, TILES, STEPS))],
                       [1], [40])


def _nv(bits: int, rank: int) -> gl.NVMMASharedLayout:
    # unswizzled: the consumer reads the boxes through reshaped views, which a swizzle would break
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=rank)


def descriptors(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, R: int, BW: int, MB: int) -> tuple:
    """The TMA descriptors of ``tma_mma_w4a16_kernel``: words int64 (N/32, 32, KB) box [4, R, 8]; the scales as
    ``tma_warp_specialized.weight_descriptors``' (box [1, BW/4, 4R]); the activations as int64 [M, K/4] (4 values
    each) box [MB, BW*4]."""
    n, k = b.shape[0], a.shape[1]
    kb, cb = k // 16, -(-k // 64)
    return (tma_desc(b.data_ptr(), torch.int64, (n // 32, 32, kb), (32 * kb, kb, 1), (4, R, 8), _nv(64, 3)),
            tma_desc(sb.data_ptr(), torch.int32, (sb.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1),
                     (1, BW // 4, 4 * R), _nv(32, 3)),
            tma_desc(a.data_ptr(), torch.int64, (a.shape[0], k // 4), (k // 4, 1), (MB, BW * 4), _nv(64, 2)))


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
           STAGES=cfg.stages, KW=cfg.k_warps, BF16=a.dtype == torch.bfloat16, num_warps=cfg.warps,
           **reg_cap(cfg.warps, cfg.ctas_per_sm))
