"""The ``mma.sync`` m16n8k16 operands of ``gemv.tma_mma_w4a16`` (whose docstring says why the operands are swapped
and how lanes take K), built from its ring's slots: the lanes of each load from shared memory (``lanes``,
``weight_lanes``, ``row_token_lanes``, ``token_lanes``; tests/test_gluon_sass.py pins their bank conflicts), the
weight's decode into A's pairs, the activations' pairing into B's, and the instruction. Only imported where
:func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..numerics import bf16x2 as _b2, fp16x2 as _h2
from .tma_warp_specialized import _e4m3, plain

_pair_bf16 = gluon.jit(_b2.pair_bf16.fn)
_scaled_bf16 = gluon.jit(_b2.scaled_bf16.fn)
_pair_f16 = gluon.jit(_h2._pair.fn)
TWO_7 = gl.constexpr(128.0)  # fp16: the placement's 2**-14 times scale * 2**7 leaves 2**-7
_MMA_BF16 = gl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
                         "{$10,$11,$12,$13};")
_MMA_F16 = gl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
                        "{$10,$11,$12,$13};")


@gluon.jit
def _scale(u8, BF16: gl.constexpr):
    """e4m3 bytes -> the pair multiplier with the scale in both halves: bf16x2 of scale * 2**119 (``bf16x2``'s) or
    fp16x2 of scale * 2**7 (exact; a NaN scale stays NaN)."""
    if BF16:
        h = (_e4m3(u8) * _b2.TWO_119).to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    else:
        h = (_e4m3(u8) * TWO_7).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
    return h | (h << 16)


@gluon.jit
def value(w, J: gl.constexpr, sc, BF16: gl.constexpr):
    """Nibbles J, J+4 of the words times their block scale: exact pairs of e2m1 * e4m3 * 2**-7 (bf16:
    ``bf16x2.scaled_bf16``)."""
    if BF16:
        return _scaled_bf16(_pair_bf16(w, J), sc)
    else:
        return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [_pair_f16(w, J), sc],
                                         dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def prmt(a, b, SEL: gl.constexpr):
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def mma(a0, a1, a2, a3, b0, b1, acc, BF16: gl.constexpr):
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
def _b(x, LA: gl.constexpr, zero):
    """[8, KW, C, 4] -> [RG, 8, KW, C, 4] uint32 (the same for every row group)."""
    return (gl.expand_dims(gl.convert_layout(x, LA), 0) + zero).to(gl.uint32, bitcast=True)


@gluon.jit
def tokens(a_s, s, half: gl.constexpr, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """Slot s's activation pairs of tokens 8*half + g (rows 1: token 0 in every lane, a broadcast read): 16 uint32
    tensors in L, Q = 0..7 of block 2t then 0..7 of block 2t + 1 (Q: the pair of k = 2Q, 2Q + 1)."""
    STAGES: gl.constexpr = a_s.type.shape[0]
    MB: gl.constexpr = a_s.type.shape[1]
    NB: gl.constexpr = 8 if MB > 1 else 1
    q = a_s._reinterpret(gl.int32, [STAGES * MB // NB, NB, KW, C, 4, 16], plain(5)).index(
        s * (MB // NB) + half).load(row_token_lanes(C, KW, RG))
    q = gl.reshape(q, [NB, KW, C, 4, 2, 2, 2, 2])  # (.., block, Q // 4, Q // 2 % 2, Q % 2)
    x0, x1 = gl.split(q)
    return _pairs(x0, x1, RG, KW, C, L)


@triton.constexpr_function
def weight_lanes(c: int, kw: int, rg: int) -> gl.BlockedLayout:
    """The lanes of ``tma_mma_w4a16._step``'s load of a slot's words, [KW, C, RG, 2 (h), 8 (g), 4 (t), 2 (b)] int64
    (its chunks' boxes [4, R, 8] viewed so): lane 4g + t takes blocks 2t and 2t + 1 (16 bytes) of rows g and 8 + g
    of each chunk of its warp's K share; warp kw + KW * rg."""
    c, kw, rg = (getattr(v, "value", v) for v in (c, kw, rg))
    return gl.BlockedLayout([1, c, 1, 2, 1, 1, 2], [1, 1, 1, 1, 8, 4, 1], [kw, 1, rg, 1, 1, 1, 1],
                            [6, 3, 1, 5, 4, 0, 2])


@triton.constexpr_function
def row_token_lanes(c: int, kw: int, rg: int) -> gl.BlockedLayout:
    """The lanes of ``tokens``' load of an unswizzled slot of whole token rows, [NB, KW, C, 4 (t), 16] int32: lane
    4g + t takes token g's pairs of blocks 2t and 2t + 1 (64 bytes) of each chunk of its warp's K share."""
    c, kw, rg = (getattr(v, "value", v) for v in (c, kw, rg))
    return gl.BlockedLayout([1, 1, c, 1, 16], [8, 1, 1, 4, 1], [rg, kw, 1, 1, 1], [4, 2, 3, 1, 0])


@triton.constexpr_function
def token_lanes(mb: int, c: int, kw: int, rg: int) -> gl.DistributedLinearLayout:
    """The lanes of ``tokens_swizzled``'s load of a slot, [KW * C * MB, 2, 16] int64 ((chunk, token), line of the
    chunk, int64 of the line): registers the 8 int64 of a half line (i), the token tile (token + 8) and the chunks
    of the warp's K share; lane 4g + t takes token g, line t // 2, half line t % 2; warp kw + KW * rg takes chunks
    kw * C.. (the RG row groups repeat the load). One token row: every g reads it (the MMA's 8 columns alike)."""
    mb, c, kw, rg = (getattr(v, "value", v) for v in (mb, c, kw, rg))
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4]] + ([[8, 0, 0]] if mb > 8 else [])
    regs += [[mb << j, 0, 0] for j in range(c.bit_length() - 1)]
    lanes_ = [[0, 0, 8], [0, 1, 0]] + ([[1, 0, 0], [2, 0, 0], [4, 0, 0]] if mb > 1 else [[0, 0, 0]] * 3)
    warps = [[c * mb << j, 0, 0] for j in range(kw.bit_length() - 1)] + [[0, 0, 0]] * (rg.bit_length() - 1)
    return gl.DistributedLinearLayout(regs, lanes_, warps, [], [kw * c * mb, 2, 16])


@gluon.jit
def tokens_swizzled(a_s, s, STAGES: gl.constexpr, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr,
                     L: gl.constexpr):
    """``tokens`` of both token tiles (with 1 or 8 rows, the one tile twice) from a ring slot of boxes of 128-byte
    lines of int64 under the 128-byte swizzle (``swizzled_tokens``): [MB, 2, 16] per chunk, or one [1, 2 * CH, 16].
    A token row of a chunk is two lines, so the 16 bytes each lane of a quarter warp reads (tokens g and g + 1, line
    t // 2, half line t % 2) lie in 8 different bank groups; unswizzled they would lie in 2 (every token row starts
    in the same bank). Each lane gets, per chunk, the 8 int64 of its blocks 2t and 2t + 1 of tokens g and 8 + g:
    int64 i holds the pairs Q = 2i (low half) and 2i + 1."""
    MB: gl.constexpr = a_s.shape[1]
    H: gl.constexpr = MB // 8
    y = a_s._reinterpret(gl.int64, [STAGES, KW * C * MB, 2, 16], a_s.layout).index(s).load(
        token_lanes(MB, C, KW, RG))
    if MB == 1:
        q = _pairs_of_words(gl.reshape(y, [1, KW, C, 4, 8]), RG, KW, C, L)  # (kw, c, t // 2, t % 2, i)
        q2 = q
    else:
        y = gl.reshape(y, [KW, C, H, 8, 2, 2, 8])  # (kw, c, half, g, t // 2, t % 2, i)
        y = gl.reshape(gl.permute(y, (3, 0, 1, 4, 5, 6, 2)), [8, KW, C, 4, 8, H])
        if H == 2:
            y0, y1 = gl.split(y)
            q = _pairs_of_words(y0, RG, KW, C, L)
            q2 = _pairs_of_words(y1, RG, KW, C, L)
        else:
            q = _pairs_of_words(gl.reshape(y, [8, KW, C, 4, 8]), RG, KW, C, L)
            q2 = q
    return q, q2


@gluon.jit
def _pairs_of_words(y, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """[NB, KW, C, 4, 8] int64 (i = 4 * block + Q // 2 within the lane's two blocks) -> ``_pairs``."""
    NB: gl.constexpr = y.shape[0]
    x0 = gl.reshape(y.to(gl.int32), [NB, KW, C, 4, 2, 2, 2])
    x1 = gl.reshape((y >> 32).to(gl.int32), [NB, KW, C, 4, 2, 2, 2])
    return _pairs(x0, x1, RG, KW, C, L)


@gluon.jit
def _pairs(x0, x1, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """The activation pairs Q % 2 == 0 (x0) and 1 (x1), each [NB, KW, C, 4, 2 (block), 2 (Q // 4),
    2 (Q // 2 % 2)], as the 16 uint32 tensors in L that ``tokens`` returns."""
    zero = gl.zeros([RG, 8, KW, C, 4], gl.int32, L)
    LA: gl.constexpr = gl.SliceLayout(0, L)
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
def scales(ws_s, s, RG: gl.constexpr, KW: gl.constexpr, C: gl.constexpr, L: gl.constexpr, BF16: gl.constexpr):
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
