"""``@triton.jit`` code of ``mma16``: tensor-core NVFP4 x NVFP4 that decodes 32-bit words straight to fp16.

One uint32 word holds 8 nibbles (8 consecutive k of one 16-block). An inline-PTX block turns it into 8 fp16 values
already multiplied by the block scale: per pair of nibbles (j, j+4) two shifts, two masks and an or place ``e e m`` at
fp16 bits 9..11 and the sign at bit 15 of each half (the exact ``e2m1 * 2**-14``), one ``mul.f16x2`` applies the scale,
and the halves go out as two fp16 registers. The e4m3 scale becomes fp16 with integer ops (its bits shifted into the
fp16 field read ``s * 2**-8``; one ``mul.f16x2`` by 256 restores it; 0x7F/0xFF become NaN). Every decoded value
``e2m1 * s * 2**-14`` is exact in fp16 (the smallest, ``0.5 * 2**-9 * 2**-14``, is fp16's smallest subnormal), each
fp16 x fp16 product is exact in fp32, and the dot accumulates in fp32; the epilogue multiplies by ``2**28`` (exact),
then alpha.

The 8 outputs of a word are 8 separate [rows, BKW] tensors, one per nibble position, so a K step is 8 dots of
K = BKW; A and B use the same positions, so the sum over k is complete without interleaving anything.
Under the interpreter (no PTX) the same values are formed in fp32 and the dots run in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._fused import _halves, _pair, e4m3_to_f32, store_out, swz

TWO_28 = tl.constexpr(268435456.0)  # 2**28: undoes the 2**-14 of both operands

_PAIR_PTX = "shl.b32 t, $8, {a}; and.b32 t, t, 0x0E000E00; shl.b32 u, $8, {b}; and.b32 u, u, 0x80008000; "
_DEC_PTX = tl.constexpr(
    "{ .reg .b32 s, t, u, p; mov.b32 t, 0x5C005C00; mul.rn.f16x2 s, $9, t; "
    + "".join(_PAIR_PTX.format(a=9 - 4 * j, b=12 - 4 * j) + f"or.b32 p, t, u; mul.rn.f16x2 p, p, s; "
              f"mov.b32 {{${j}, ${j + 4}}}, p; " for j in range(3))
    + "shr.b32 t, $8, 3; and.b32 t, t, 0x0E000E00; and.b32 u, $8, 0x80008000; or.b32 p, t, u; "
      "mul.rn.f16x2 p, p, s; mov.b32 {$3, $7}, p; }")
_DEC_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


@triton.jit
def _scale_h2(b):
    """e4m3 bytes (uint32) -> fp16x2 bits of (s * 2**-8, s * 2**-8); 0x7F/0xFF -> NaN."""
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    h = tl.where((b & 0x7F) == 0x7F, 0x7E00, h)
    return h | (h << 16)


@triton.jit
def _operand16(p_ptr, s_ptr, rows, nrows, kk, kw_hi, KW, CB, ASM: tl.constexpr):
    """8 tensors [R, BKW], one per nibble position of the words kk: value * scale * 2**-14 (fp16; fp32 when not
    ASM)."""
    m = (rows[:, None] < nrows) & (kk[None, :] < kw_hi)
    w = tl.load(p_ptr + rows[:, None].to(tl.int64) * KW + kk[None, :], mask=m, other=0).to(tl.uint32)
    sb = tl.load(s_ptr + swz(rows[:, None], kk[None, :] // 2, CB), mask=m, other=0).to(tl.uint32)
    if ASM:
        return tl.inline_asm_elementwise(_DEC_PTX, _DEC_CONSTRAINTS, [w, _scale_h2(sb)], dtype=(tl.float16,) * 8,
                                         is_pure=True, pack=1)
    else:
        s = e4m3_to_f32(sb)
        l0, h0 = _halves(_pair(w, 0))
        l1, h1 = _halves(_pair(w, 1))
        l2, h2 = _halves(_pair(w, 2))
        l3, h3 = _halves(_pair(w, 3))
        return l0 * s, l1 * s, l2 * s, l3 * s, h0 * s, h1 * s, h2 * s, h3 * s


@triton.jit
def _joined(v, R: tl.constexpr, BKW: tl.constexpr):
    """The 8 position tensors as one [R, BKW*8] operand (k order permuted within each word, the same for A and B)."""
    x = tl.join(tl.join(tl.join(v[0], v[4]), tl.join(v[2], v[6])), tl.join(tl.join(v[1], v[5]), tl.join(v[3], v[7])))
    return tl.reshape(x, (R, BKW * 8))


@triton.jit
def mma16_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, M, N, KW, CB, words_per_split,
                 BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, GROUP_M: tl.constexpr,
                 ATOMIC: tl.constexpr, ASM: tl.constexpr, JOIN: tl.constexpr = False):
    """Tiled GEMM over uint32 words (a, b viewed as int32 [rows, K/8]); 8 fp16 dots per K step, fp32 accumulate;
    split-K by program_id(1) as in ``mma_kernel``."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    t = tl.arange(0, BKW)
    kw_lo = pid_k * words_per_split
    kw_hi = tl.minimum(kw_lo + words_per_split, KW)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kw0 in range(kw_lo, kw_hi, BKW):
        kk = kw0 + t
        if JOIN:
            a = _joined(_operand16(a_ptr, sa_ptr, rm, M, kk, kw_hi, KW, CB, ASM), BM, BKW)
            b = _joined(_operand16(b_ptr, sb_ptr, rn, N, kk, kw_hi, KW, CB, ASM), BN, BKW)
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = _operand16(a_ptr, sa_ptr, rm, M, kk, kw_hi, KW, CB, ASM)
            b0, b1, b2, b3, b4, b5, b6, b7 = _operand16(b_ptr, sb_ptr, rn, N, kk, kw_hi, KW, CB, ASM)
            acc = tl.dot(a0, tl.trans(b0), acc)
            acc = tl.dot(a1, tl.trans(b1), acc)
            acc = tl.dot(a2, tl.trans(b2), acc)
            acc = tl.dot(a3, tl.trans(b3), acc)
            acc = tl.dot(a4, tl.trans(b4), acc)
            acc = tl.dot(a5, tl.trans(b5), acc)
            acc = tl.dot(a6, tl.trans(b6), acc)
            acc = tl.dot(a7, tl.trans(b7), acc)
    store_out(acc * TWO_28, rm, rn, M, N, alpha_ptr, out_ptr, ATOMIC)
