"""``@triton.jit`` code of the NVFP4 quantize kernel (host side: ``quantize.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .numerics.e2m1_e4m3 import e4m3_to_f32, swz


@triton.jit
def f32_to_e4m3(v):
    """fp32 -> float8_e4m3fn byte (uint32), round to nearest even, saturating at 448; NaN -> 0x7F."""
    bits = v.to(tl.uint32, bitcast=True)
    sgn = (bits >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.uint32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    sub = (((a * 512.0) + 8388608.0) - 8388608.0).to(tl.uint32)  # RNE to an integer count of 2**-9
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.where(a > 448.0, 0x7E, code)
    code = tl.where(a != a, 0x7F, code)
    return code | sgn

@triton.jit
def quant_kernel(x_ptr, gs_ptr, p_ptr, s_ptr, M, K, KB, CB,
                 BM: tl.constexpr, BKB: tl.constexpr, SWIZZLED: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    blk = tl.program_id(1) * BKB + tl.arange(0, BKB)
    i8 = tl.arange(0, 8)
    t2 = tl.arange(0, 2)
    m2 = (rows[:, None] < M) & (blk[None, :] < KB)
    offs = rows[:, None, None, None].to(tl.int64) * K + (blk[None, :, None, None] * 16
                                                         + i8[None, None, :, None] * 2 + t2[None, None, None, :])
    x = tl.load(x_ptr + offs, mask=m2[:, :, None, None], other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr)
    bamax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)
    sf32 = tl.math.div_rn(bamax * gs, 6.0)
    sf32 = tl.where(sf32 > 448.0, 448.0, sf32)  # clamp(max=448) that keeps NaN, like torch.clamp
    sfc = f32_to_e4m3(sf32)
    sfd = e4m3_to_f32(sfc)
    inv = tl.where(sfd > 0, tl.math.div_rn(gs + tl.zeros_like(sfd), sfd), 0.0)
    v = x * inv[:, :, None, None]
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.uint32) + (a >= 0.75).to(tl.uint32) + (a > 1.25).to(tl.uint32)
            + (a >= 1.75).to(tl.uint32) + (a > 2.5).to(tl.uint32) + (a >= 3.5).to(tl.uint32)
            + (a > 5.0).to(tl.uint32))
    code = code | ((v.to(tl.uint32, bitcast=True) >> 31) << 3)
    lo, hi = tl.split(code)
    byte = (lo | (hi << 4)).to(tl.uint8)
    po = rows[:, None, None].to(tl.int64) * (K // 2) + (blk[None, :, None] * 8 + i8[None, None, :])
    tl.store(p_ptr + po, byte, mask=m2[:, :, None])
    if SWIZZLED:
        so = swz(rows[:, None], blk[None, :], CB)
    else:
        so = rows[:, None].to(tl.int64) * KB + blk[None, :]
    tl.store(s_ptr + so, sfc.to(tl.uint8), mask=m2)
