"""``@triton.jit`` code of the int8 dot-product path of ``gvws`` (``DP``; GPU only: inline PTX, SM61+).

Twice an e2m1 value is one of the integers 0, 1, 2, 3, 4, 6, 8, 12 with a sign, so a 16-block's sum of products
(2w)(2a) is an exact int32 (|sum| <= 16 * 144), formed four products per ``dp4a``. A ``prmt`` looks the eight
magnitudes up from a two-register table, four nibbles per instruction. Its selector's top bit (the e2m1 sign)
replicates the looked-up byte's sign bit instead, which is 0 for every magnitude: so ``prmt`` of the word gives the
magnitudes of the positive codes (0 for the negative ones), and ``prmt`` of the word with its sign bits flipped gives
those of the negative ones. B's two magnitude sets each go through ``dp4a`` with A's signed bytes, and their
difference is the block sum. A (shared by all rows) is made signed once per word.

Per B word (8 values) that is 11 instructions (an xor, two shifts, four ``prmt``, four ``dp4a``), against 15 for the
fp16x2 path (``_h2.h2_block_cvt``: 7 integer ops and 4 conversions to fp16 pairs, 4 ``fma.rn.f16x2``): gvws's step
loop takes about a fifth fewer instructions, with the table kept in registers (``table``).
"""
from __future__ import annotations

import triton
import triton.language as tl

DP_UNDO = tl.constexpr(0.25)  # each product is (2w)(2a)

# The table: bytes 0..7 = 2 * e2m1 magnitude of codes 0..7, two words passed to the asm as operands (``table``)
TABLE = (0x03020100, 0x0C080604)
_T0 = tl.constexpr(TABLE[0])
_T1 = tl.constexpr(TABLE[1])
_ACT_PTX = tl.constexpr(
    "{ .reg .b32 x, h, p, n; "
    "xor.b32 x, $2, 0x88888888; "
    "prmt.b32 p, $3, $4, $2; prmt.b32 n, $3, $4, x; "
    "or.b32 p, p, 0x80808080; sub.u32 p, p, n; xor.b32 $0, p, 0x80808080; "
    "shr.b32 h, $2, 16; shr.b32 x, x, 16; "
    "prmt.b32 p, $3, $4, h; prmt.b32 n, $3, $4, x; "
    "or.b32 p, p, 0x80808080; sub.u32 p, p, n; xor.b32 $1, p, 0x80808080; }")


def _word(w: str, a_lo: str, a_hi: str) -> str:
    """PTX adding B word ``w``'s products with A's signed bytes (k 0..3 in a_lo, 4..7 in a_hi) to sp and sn."""
    return (f"xor.b32 x, {w}, 0x88888888; prmt.b32 p, $7, $8, {w}; prmt.b32 n, $7, $8, x; "
            f"dp4a.u32.s32 sp, p, {a_lo}, sp; dp4a.u32.s32 sn, n, {a_lo}, sn; "
            f"shr.b32 h, {w}, 16; shr.b32 x, x, 16; prmt.b32 p, $7, $8, h; prmt.b32 n, $7, $8, x; "
            f"dp4a.u32.s32 sp, p, {a_hi}, sp; dp4a.u32.s32 sn, n, {a_hi}, sn; ")


_BLOCK_PTX = tl.constexpr("{ .reg .b32 x, h, p, n, sp, sn; mov.b32 sp, 0; mov.b32 sn, 0; " +
                          _word("$1", "$3", "$4") + _word("$2", "$5", "$6") + "sub.s32 $0, sp, sn; }")


@triton.jit
def table(n):
    """The two table words as values ptxas cannot fold, from ``n``, any int32 >= 0 that is not a compile-time constant
    (n >> 31 == 0). As constants ptxas copies them from a uniform register before every ``prmt`` (a fifth more
    instructions in gvws's step); note a launch makes an int argument equal to 1 a constant (gvws passes N, a
    multiple of 32, not M)."""
    return (n >> 31) ^ _T0, (n >> 31) ^ _T1


@triton.jit
def act_i8(w, t0, t1):
    """uint32 words of A (8 nibbles, k 0..7) -> (k 0..3, k 4..7) as signed int8x4 of 2 * e2m1 (int32 bits).
    Positive minus negative magnitudes, bytewise with no borrow: (p | 0x80) - n stays in 116..140 per byte."""
    return tl.inline_asm_elementwise(_ACT_PTX, "=r,=r,r,r,r", [w, t0, t1], dtype=(tl.int32, tl.int32), is_pure=True,
                                     pack=1)


@triton.jit
def dp_block(b_lo, b_hi, a0, a1, a2, a3, t0, t1):
    """Sum over one 16-block of (2w)(2a) as exact int32: B's uint32 words b_lo (k 0..7), b_hi (k 8..15); A's signed
    bytes a0..a3 (k 0..3, ..., 12..15, from ``act_i8``)."""
    return tl.inline_asm_elementwise(_BLOCK_PTX, "=r,r,r,r,r,r,r,r,r", [b_lo, b_hi, a0, a1, a2, a3, t0, t1],
                                     dtype=tl.int32, is_pure=True, pack=1)
