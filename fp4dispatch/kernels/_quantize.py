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
    """Blocks of BM rows x BKB 16-element blocks. With SWIZZLED the grid also covers the scale layout's padding
    (rows up to a multiple of 128, blocks up to a multiple of 4), which it writes as zero scales: no memset launch
    before it."""
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
    # torch's amax is NaN for a block that holds one; tl.max need not be
    bamax = tl.where(tl.max(tl.max((x != x).to(tl.int32), axis=3), axis=2) > 0, float("nan"), bamax)
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
        pad = (rows[:, None] < (M + 127) // 128 * 128) & (blk[None, :] < CB * 4)
        tl.store(s_ptr + so, tl.where(m2, sfc, 0).to(tl.uint8), mask=pad)
    else:
        so = rows[:, None].to(tl.int64) * KB + blk[None, :]
        tl.store(s_ptr + so, sfc.to(tl.uint8), mask=m2)


@triton.jit
def amax_scale_kernel(x_ptr, part_ptr, cnt_ptr, gs_ptr, N, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """``format.default_global_scale`` on the device, bit for bit: amax(|x|) (NaN if x holds a NaN), then
    ``reciprocal(amax) * 2688`` (torch's ``2688 / t`` is that product) or 1.0 where amax is not > 0. Each program
    stores the max of its strided chunks in part_ptr; the program that arrives last (cnt_ptr counts, starting at
    zero) reduces the partials, writes gs and sets the counter back to zero for the next launch."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    m = tl.zeros((BLOCK,), dtype=tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(pid * BLOCK, N, progs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        bad = tl.maximum(bad, (x != x).to(tl.int32))
        m = tl.maximum(m, tl.where(x != x, 0.0, tl.abs(x)))
    part = tl.max(m, axis=0)
    part = tl.where(tl.max(bad, axis=0) > 0, float("nan"), part)
    tl.store(part_ptr + pid, part)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == progs - 1:
        i = tl.arange(0, PARTS)
        p = tl.load(part_ptr + i, mask=i < progs, other=0.0, cache_modifier=".cg")
        amax = tl.max(tl.where(p != p, 0.0, p), axis=0)
        amax = tl.where(tl.max((p != p).to(tl.int32), axis=0) > 0, float("nan"), amax)
        gs = tl.where(amax > 0, tl.math.div_rn(1.0, amax) * 2688.0, 1.0)
        tl.store(gs_ptr, gs)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
