"""bf16x2 weight values in ``@triton.jit`` code: the bf16 form of ``fp16x2._pair`` and of the block-scale multiply,
for ``gemm.wgmma_register_a``'s decode when the other operand is bf16 activations (``w4a16_mm``).

A nibble ``s e e m`` placed as bf16 bits (``e e m`` to bits 6..8, the sign to bit 15, in each half) is the exact bf16
``e2m1 * 2**-126`` (code 0.5 lands on a bf16 subnormal, which ``fma.rn.bf16x2`` takes as it is: no flush to zero
exists for bf16 in PTX). One ``fma.rn.bf16x2`` by the block scale times 2**119 (at most 448 * 2**119, below bf16's
largest) gives ``e2m1 * e4m3 * 2**-7``: at most 6 significant bits, from 2**-17 to 21, so exact in bf16 and equal
to the fp16 decode's values.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .e2m1_e4m3 import e4m3_to_f32

TWO_119 = tl.constexpr(6.646139978924579e35)  # 2**119: folds the nibble's 2**-126 into the scale, leaving 2**-7


@triton.jit
def pair_bf16(w, J: tl.constexpr):
    """Nibbles J and J+4 (J = 0..3) of uint32 words as bf16x2 bits (e2m1 * 2**-126 each); the pairs of
    ``fp16x2._pair``, so both decodes give the same K order."""
    if J < 2:
        e = w << (6 - 4 * J)
    else:
        e = w >> (4 * J - 6)
    return (e & 0x01C001C0) | ((w << (12 - 4 * J)) & 0x80008000)


@triton.jit
def scale_bf16x2(s):
    """e4m3 scale bytes -> bf16x2 bits (scale * 2**119 in both halves; a NaN scale stays NaN)."""
    h = (e4m3_to_f32(s) * TWO_119).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return h | (h << 16)


@triton.jit
def scaled_bf16(p, sc):
    """Pair bits from :func:`pair_bf16` times the block scale from :func:`scale_bf16x2`, exact (the -0.0 addend
    keeps a zero product's sign)."""
    return tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
                                     "=r,r,r", [p, sc], dtype=tl.uint32, is_pure=True, pack=1)
