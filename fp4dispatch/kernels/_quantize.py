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
def f32_to_e2m1(v):
    """fp32 -> e2m1 code (uint32, sign in bit 3), round to nearest even, saturating at 6; NaN -> 0 (with its sign).
    Bit arithmetic rather than a compare per grid point: the kernel is bound by its instructions per element.
    |v| >= 1: fp32 rounded to one mantissa bit; its (exponent, mantissa) are the code's bits, past 6 clamped.
    |v| < 1: 2|v| rounded to an integer (0, 1 or 2: 0, 0.5, 1.0) by adding 2**23."""
    a = tl.abs(v)
    ab = a.to(tl.uint32, bitcast=True)
    normal = tl.minimum(((ab + 0x1FFFFF + ((ab >> 22) & 1)) >> 22) - 252, 7)
    sub = (a * 2.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(a < 1.0, sub, tl.where(a >= 1.0, normal, 0))
    return code | ((v.to(tl.uint32, bitcast=True) >> 28) & 8)


@triton.jit
def max_keeping_nan(v, axis: tl.constexpr):
    """The max over ``axis`` of non-negative values, NaN where one is NaN: tl.max need not keep a NaN; their sum is
    NaN just then (no inf - inf among non-negative values). Not a ``tl.reduce`` with a NaN-keeping combine: the
    interpreter runs that one element at a time."""
    s = tl.sum(v, axis=axis)
    return tl.where(s != s, float("nan"), tl.max(v, axis=axis))


@triton.jit
def scale_from_parts(part_ptr, nparts, PARTS: tl.constexpr):
    """The global scale from ``amax_scale_kernel``'s ``nparts`` partial maxima of the finite values (PARTS >= nparts,
    a power of two): ``reciprocal(amax) * 2688`` (torch's ``2688 / t`` is that product), or 1.0 where that is not a
    finite positive number. Loaded past L1 (``.cg``): other programs of the same launch may just have written them."""
    i = tl.arange(0, PARTS)
    amax = tl.max(tl.load(part_ptr + i, mask=i < nparts, other=0.0, cache_modifier=".cg"), 0)
    gs = tl.math.div_rn(1.0, amax) * 2688.0
    return tl.where((amax > 0) & (gs < float("inf")), gs, 1.0)


@triton.jit
def quant_kernel(x_ptr, gs_ptr, part_ptr, NPARTS, p_ptr, s_ptr, M, K, KB, CB, RP, BM: tl.constexpr,
                 BKB: tl.constexpr, SWIZZLED: tl.constexpr, PADB: tl.constexpr, PARTS: tl.constexpr):
    """Blocks of BM rows x BKB 16-element blocks, loaded and stored as 2-D row segments (16-byte vectors; a 4-D
    pointer tensor would split them into 4-byte loads). With SWIZZLED the grid also covers the scale layout's
    padding columns (up to a multiple of 4 blocks) and the last row program writes the padding rows (up to RP, a
    multiple of 128) as zero scales, PADB rows at a time: no memset launch before it, no program for padding alone.
    PARTS > 0: the global scale is not given but derived here from the NPARTS partial maxima of
    ``amax_scale_kernel`` (FINISH off), as that kernel's last program would, and program (0, 0) stores it at gs_ptr
    (a small input: its amax launch then ends without an atomic and a second round trip)."""
    pid_m = tl.program_id(0)
    if PARTS > 0:
        gs = scale_from_parts(part_ptr, NPARTS, PARTS)
        if (pid_m == 0) & (tl.program_id(1) == 0):
            tl.store(gs_ptr, gs)
    else:
        gs = tl.load(gs_ptr)
    rows = pid_m * BM + tl.arange(0, BM)
    blk = tl.program_id(1) * BKB + tl.arange(0, BKB)
    cols = tl.program_id(1) * BKB * 16 + tl.arange(0, BKB * 16)
    rmask = rows < M
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K),
                other=0.0).to(tl.float32)
    x = tl.reshape(x, (BM, BKB, 16))
    bamax = max_keeping_nan(tl.abs(x), 2)  # torch's amax is NaN for a block that holds one
    sf32 = tl.math.div_rn(bamax * gs, 6.0)
    sf32 = tl.where(sf32 > 448.0, 448.0, sf32)  # clamp(max=448) that keeps NaN, like torch.clamp
    sfc = f32_to_e4m3(sf32)
    sfd = e4m3_to_f32(sfc)
    inv = tl.where(sfd > 0, tl.math.div_rn(gs + tl.zeros_like(sfd), sfd), 0.0)
    v = x * inv[:, :, None]
    lo, hi = tl.split(tl.reshape(f32_to_e2m1(v), (BM, BKB * 8, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)
    pcols = tl.program_id(1) * BKB * 8 + tl.arange(0, BKB * 8)
    tl.store(p_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], byte,
             mask=rmask[:, None] & (pcols[None, :] < K // 2))
    m2 = rmask[:, None] & (blk[None, :] < KB)
    if SWIZZLED:
        cmask = blk[None, :] < CB * 4
        tl.store(s_ptr + swz(rows[:, None], blk[None, :], CB), tl.where(m2, sfc, 0).to(tl.uint8),
                 mask=(rows[:, None] < RP) & cmask)
        if pid_m == (M - 1) // BM:
            for r0 in range(pid_m * BM + BM, RP, PADB):
                prow = r0 + tl.arange(0, PADB)
                tl.store(s_ptr + swz(prow[:, None], blk[None, :], CB), tl.zeros((PADB, BKB), dtype=tl.uint8),
                         mask=(prow[:, None] < RP) & cmask)
    else:
        tl.store(s_ptr + rows[:, None].to(tl.int64) * KB + blk[None, :], sfc.to(tl.uint8), mask=m2)


@triton.jit
def amax_scale_kernel(x_ptr, part_ptr, cnt_ptr, gs_ptr, N, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                      FINISH: tl.constexpr):
    """``format.default_global_scale`` on the device, bit for bit: the amax of x's finite values (a NaN or inf counts
    as 0), then ``scale_from_parts``. Each program stores the max of its strided chunks in part_ptr; with FINISH the
    program that arrives last (cnt_ptr counts, starting at zero) writes gs from them and sets the counter back to
    zero for the next launch (without, ``quant_kernel`` does)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    m = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, N, progs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
        m = tl.maximum(m, tl.where(a < float("inf"), a, 0.0))  # NaN < inf is false too
    tl.store(part_ptr + pid, tl.max(m, 0))
    if FINISH:
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == progs - 1:
            tl.store(gs_ptr, scale_from_parts(part_ptr, progs, PARTS))
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
