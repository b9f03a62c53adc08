"""``@triton.jit`` code of the NVFP4 -> bf16/fp16 dequantize kernel (host side: ``dequant.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .expert_rows import expert_bounds, scale_rows
from .gemm.wgmma_register_a import to_k_order
from .numerics.e2m1_e4m3 import TWO_117, load_block_bytes, load_block_bytes_at, nib_hi, nib_lo, per_byte


@triton.jit
def dequant_kernel(p_ptr, s_ptr, f_ptr, out_ptr, R, K2, KB, CB,
                   BR: tl.constexpr, BKB: tl.constexpr, HAS_F: tl.constexpr):
    """out[r, k] = e2m1 * e4m3 (exact in bf16/fp16), times f[0] in fp32 first when HAS_F (alpha folded in)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    kb0 = tl.program_id(1) * BKB
    u, s = load_block_bytes(p_ptr, s_ptr, rows, R, kb0, KB, K2, CB, BKB)
    f = 512.0  # undoes the 2**-9 of TWO_117 (which keeps e4m3 * 2**117 inside fp32)
    if HAS_F:
        f = f * tl.load(f_ptr)
    _store_decoded(u, s, f, rows, R, kb0, KB * 16, K2 * 2, out_ptr, BR, BKB, False)


@triton.jit
def grouped_dequant_kernel(p_ptr, s_ptr, offs_ptr, out_ptr, layout_ptr, T, K2, KB, CB, E, LDO,
                           BR: tl.constexpr, BKB: tl.constexpr, EP: tl.constexpr, KORDER: tl.constexpr = False):
    """``fp4_grouped_mm``'s activations -> bf16/fp16 (exact): each row's scales are read from its expert's block
    of the grouped swizzled layout. Program (0, 0) also writes the routing table as checked here (clamped,
    non-decreasing) with a leading 0: ``layout`` int32 [E+1], each expert's first row and then T. Rows of out are
    LDO apart; with KORDER (BKB a multiple of 4) they are written in ``wgmma_register_a.to_k_order``'s column order
    and LDO columns wide (K padded to whole groups of 4 blocks, zeros past K), which is what
    ``wgmma_register_a_w4a16.permute_a`` would make of them."""
    e, starts, ends = expert_bounds(offs_ptr, T, E, EP)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(layout_ptr + 1 + e, ends, mask=e < E)
        tl.store(layout_ptr, 0)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    srows, mine = scale_rows(rows, e, starts, ends, E)
    kb0 = tl.program_id(1) * BKB
    u, s = load_block_bytes_at(p_ptr, s_ptr, rows, srows, (rows < T) & mine, kb0, KB, K2, CB, BKB)
    # with KORDER the columns up to LDO are written: past K the masked loads decoded zeros
    _store_decoded(u, s, 512.0, rows, T, kb0, LDO if KORDER else KB * 16, LDO, out_ptr, BR, BKB, KORDER)


@triton.jit
def _store_decoded(u, s, f, rows, R, kb0, COLS, LDO, out_ptr, BR: tl.constexpr, BKB: tl.constexpr,
                   KORDER: tl.constexpr):
    """The decoded block columns [kb0*16, kb0*16 + BKB*16) of ``rows`` (< R) to out (row stride LDO), the columns
    below COLS; with KORDER in ``to_k_order``'s order (kb0 a multiple of BKB, itself a multiple of 4)."""
    BK2: tl.constexpr = BKB * 8
    s2 = per_byte(s * TWO_117, BK2)
    lo = ((nib_lo(u) * s2) * f).to(out_ptr.dtype.element_ty)
    hi = ((nib_hi(u) * s2) * f).to(out_ptr.dtype.element_ty)
    v = tl.reshape(tl.join(lo, hi), (BR, 2 * BK2))  # byte j holds k = 2j (lo) and 2j + 1 (hi)
    if KORDER:
        v = to_k_order(v, BKB)
    kk = kb0 * 16 + tl.arange(0, 2 * BK2)
    m = (rows[:, None] < R) & (kk[None, :] < COLS)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * LDO + kk[None, :], v, mask=m)
