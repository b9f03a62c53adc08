"""fp16x2 products in ``@triton.jit`` code (``CudaCoreGemvConfig.fp16x2``, the kernels' ``H2``; optionally through
the e4m3x2 conversion, ``CVT``): two exact products per ``fma.rn.f16x2`` (inline PTX). Used by ``gemv.cuda_core``,
``gemv.tma_warp_specialized`` and ``gemm.wgmma_register_a``.
"""
from __future__ import annotations

import triton
import triton.language as tl

# A pair (nibble j, nibble j+4) of a uint32 word, placed as fp16 bits (e e m to bits 9..11, sign to bit 15, in each
# half) is the exact fp16 pair (e2m1 * 2**-14): four integer ops (two shifts, two lop3) per two values. A is
# decoded the same way and multiplied by 2**13, so each product is w * a * 2**-15; a 16-block gives each half-lane 8
# products of magnitude <= 288 * 2**-15 on a 2**-17 grid, which fp16 holds exactly. The lane sums go to fp32 once per
# block and get the two block scales there. Under the interpreter (no PTX) the same sums are formed in fp32.
H2_UNDO = tl.constexpr(32768.0)  # 2**15


@triton.jit
def _pair(w, J: tl.constexpr):
    """Nibbles J and J+4 (J = 0..3) of uint32 words as fp16x2 bits (e2m1 * 2**-14 each)."""
    if J == 3:
        e = w >> 3
    else:
        e = w << (9 - 4 * J)
    return (e & 0x0E000E00) | ((w << (12 - 4 * J)) & 0x80008000)


@triton.jit
def _halves(x):
    """fp16x2 bits -> (low half, high half) as fp32 (interpreter path)."""
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _a_pair(w, J: tl.constexpr, ASM: tl.constexpr):
    """A's pair J times 2**13: fp16x2 bits (ASM) or an (lo, hi) fp32 tuple."""
    p = _pair(w, J)
    if ASM:
        return tl.inline_asm_elementwise("{ .reg .b32 c; mov.b32 c, 0x70007000; mul.rn.f16x2 $0, $1, c; }",
                                         "=r,r", [p], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        lo, hi = _halves(p)
        return lo * 8192.0, hi * 8192.0


@triton.jit
def h2_block(b_lo, b_hi, a_lo, a_hi, ASM: tl.constexpr):
    """sum over one 16-block (uint32 words b_lo/b_hi of B, a_lo/a_hi of A) of w * a * 2**-15, exact, as fp32."""
    a0 = _a_pair(a_lo, 0, ASM)
    a1 = _a_pair(a_lo, 1, ASM)
    a2 = _a_pair(a_lo, 2, ASM)
    a3 = _a_pair(a_lo, 3, ASM)
    a4 = _a_pair(a_hi, 0, ASM)
    a5 = _a_pair(a_hi, 1, ASM)
    a6 = _a_pair(a_hi, 2, ASM)
    a7 = _a_pair(a_hi, 3, ASM)
    if ASM:
        acc = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [_pair(b_lo, 0), a0],
                                        dtype=tl.uint32, is_pure=True, pack=1)
        acc = _fma2(_pair(b_lo, 1), a1, acc)
        acc = _fma2(_pair(b_lo, 2), a2, acc)
        acc = _fma2(_pair(b_lo, 3), a3, acc)
        acc = _fma2(_pair(b_hi, 0), a4, acc)
        acc = _fma2(_pair(b_hi, 1), a5, acc)
        acc = _fma2(_pair(b_hi, 2), a6, acc)
        acc = _fma2(_pair(b_hi, 3), a7, acc)
        return _h2_sum(acc)
    else:
        s = _h2_term(_pair(b_lo, 0), a0)
        s += _h2_term(_pair(b_lo, 1), a1)
        s += _h2_term(_pair(b_lo, 2), a2)
        s += _h2_term(_pair(b_lo, 3), a3)
        s += _h2_term(_pair(b_hi, 0), a4)
        s += _h2_term(_pair(b_hi, 1), a5)
        s += _h2_term(_pair(b_hi, 2), a6)
        s += _h2_term(_pair(b_hi, 3), a7)
        return s


# CVT: a word's nibbles become e4m3 bytes (s 0 0 e e m 0 0 = e2m1 * 2**-6) with one shift and two lop3 per 4 values,
# and cvt.rn.f16x2.e4m3x2 (SM89+) turns two bytes into an fp16 pair. A and B use the same lane order, products are
# w * a * 2**-12, and a 16-block's half-lane sums (8 products, grid 2**-14, below 2**-3) are exact in fp16.
H2_UNDO_CVT = tl.constexpr(4096.0)  # 2**12
_CVT_PTX = tl.constexpr(
    "{ .reg .b32 x, y, t; .reg .b16 x0, x1, y0, y1; "
    "shr.b32 t, $4, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 x, $4, 0x80808080; or.b32 x, x, t; "
    "shl.b32 t, $4, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 y, $4, 4; and.b32 y, y, 0x80808080; or.b32 y, y, t; "
    "mov.b32 {x0, x1}, x; mov.b32 {y0, y1}, y; "
    "cvt.rn.f16x2.e4m3x2 $0, y0; cvt.rn.f16x2.e4m3x2 $1, x0; cvt.rn.f16x2.e4m3x2 $2, y1; "
    "cvt.rn.f16x2.e4m3x2 $3, x1; }")


@triton.jit
def _cvt4(w):
    """uint32 words -> 4 fp16x2 (bits) holding the 8 nibbles * 2**-6."""
    return tl.inline_asm_elementwise(_CVT_PTX, "=r,=r,=r,=r,r", [w], dtype=(tl.uint32,) * 4, is_pure=True, pack=1)


@triton.jit
def h2_block_cvt(b_lo, b_hi, a_lo, a_hi):
    """sum over one 16-block of w * a * 2**-12, exact, as fp32 (GPU only: inline PTX, SM89+)."""
    a0, a1, a2, a3 = _cvt4(a_lo)
    a4, a5, a6, a7 = _cvt4(a_hi)
    b0, b1, b2, b3 = _cvt4(b_lo)
    b4, b5, b6, b7 = _cvt4(b_hi)
    acc = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [b0, a0], dtype=tl.uint32, is_pure=True,
                                    pack=1)
    acc = _fma2(b1, a1, acc)
    acc = _fma2(b2, a2, acc)
    acc = _fma2(b3, a3, acc)
    acc = _fma2(b4, a4, acc)
    acc = _fma2(b5, a5, acc)
    acc = _fma2(b6, a6, acc)
    acc = _fma2(b7, a7, acc)
    return _h2_sum(acc)


@triton.jit
def _h2_sum(acc):
    """fp16x2 bits -> low + high as fp32 (exact for the sums formed here)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f16 l, h; .reg .f32 fl, fh; mov.b32 {l, h}, $1; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; "
        "add.f32 $0, fl, fh; }", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fma2(x, y, acc):
    return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, y, acc], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _h2_term(p, a):
    lo, hi = _halves(p)
    return lo * a[0] + hi * a[1]
