"""``@triton.jit`` code of the NVFP4 -> bf16/fp16 dequantize kernel (host side: ``dequant.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .numerics.e2m1_e4m3 import TWO_117, load_block_bytes, nib_hi, nib_lo, per_byte


@triton.jit
def dequant_kernel(p_ptr, s_ptr, f_ptr, out_ptr, R, K2, KB, CB,
                   BR: tl.constexpr, BKB: tl.constexpr, HAS_F: tl.constexpr):
    """out[r, k] = e2m1 * e4m3 (exact in bf16/fp16), times f[0] in fp32 first when HAS_F (alpha folded in)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    kb0 = tl.program_id(1) * BKB
    BK2: tl.constexpr = BKB * 8
    u, s = load_block_bytes(p_ptr, s_ptr, rows, R, kb0, KB, K2, CB, BKB)
    f = 512.0  # undoes the 2**-9 of TWO_117 (which keeps e4m3 * 2**117 inside fp32)
    if HAS_F:
        f = f * tl.load(f_ptr)
    s2 = per_byte(s * TWO_117, BK2)
    lo = ((nib_lo(u) * s2) * f).to(out_ptr.dtype.element_ty)
    hi = ((nib_hi(u) * s2) * f).to(out_ptr.dtype.element_ty)
    v = tl.reshape(tl.join(lo, hi), (BR, 2 * BK2))  # byte j holds k = 2j (lo) and 2j + 1 (hi)
    kk = kb0 * 16 + tl.arange(0, 2 * BK2)
    m = (rows[:, None] < R) & (kk[None, :] < KB * 16)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * (K2 * 2) + kk[None, :], v, mask=m)
