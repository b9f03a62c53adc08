"""Where each expert's rows and scales are in ``fp4_grouped_mm``'s operands, read from ``offs`` on the GPU
(``@triton.jit`` helpers shared by the grouped kernel families and the grouped dequantize; the layouts are
``format_grouped``'s, drawn in docs/contract.md).

``offs`` is clamped to [0, T] and made non-decreasing here, so a wrong routing table (one the host did not check:
``check_offs=False`` or a CUDA graph replayed with new routings) cannot make a kernel read or write out of bounds.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max(x, y):
    return tl.maximum(x, y)


@triton.jit
def _running_max(x):
    return tl.associative_scan(x, 0, _max)


@triton.jit
def expert_bounds(offs_ptr, T, E, EP: tl.constexpr):
    """(experts 0..EP-1, their first rows, their end rows), clamped to [0, T] and non-decreasing; experts past E
    own no rows (start = end = 0)."""
    e = tl.arange(0, EP)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    ends = tl.where(e < E, _running_max(ends), 0)  # non-decreasing: a bad table cannot make a negative count
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    starts = tl.minimum(tl.maximum(starts, 0), T)
    starts = tl.where((e > 0) & (e < E), _running_max(starts), 0)
    return e, starts, ends


@triton.jit
def expert_tile(offs_ptr, tile, T, E, BM: tl.constexpr, EP: tl.constexpr):
    """M tile ``tile`` of the grouped grid -> (expert, its first row, its row count, its first padded scale row,
    the tile's first row inside the expert); row count 0 when the tile is past the last one."""
    e, starts, ends = expert_bounds(offs_ptr, T, E, EP)
    rows = tl.maximum(ends - starts, 0)
    tiles = (rows + BM - 1) // BM
    last = tl.cumsum(tiles, 0)  # inclusive: expert j's tiles are [last_j - tiles_j, last_j)
    owner = tl.sum((last <= tile).to(tl.int32), 0)
    mine = e == owner
    n = tl.sum(tl.where(mine, rows, 0), 0)
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, starts, 0), 0)
    pad0 = tl.sum(tl.where(e < owner, (rows + 127) // 128 * 128, 0), 0)
    return owner, row0, n, pad0, (tile - first_tile) * BM


@triton.jit
def expert_operands(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, expert, row0, pad0, N, ROW, CB, RN,
                    ALPHA_E: tl.constexpr):
    """One expert's operands as a dense kernel's: its first row of A, its weight, its activation scales (a multiple
    of 128 rows into the padded layout, so the dense swizzled offsets apply from there), its weight scales (their
    own swizzled matrix), its alpha and its first row of out. ``ROW``: a row of A or B in elements of their
    pointers (bytes, or int64 words for the GEMV)."""
    ex = expert.to(tl.int64)
    al = alpha_ptr
    if ALPHA_E:
        al = alpha_ptr + expert
    return (a_ptr + row0.to(tl.int64) * ROW, b_ptr + ex * N * ROW, sa_ptr + (pad0 // 128).to(tl.int64) * CB * 512,
            sb_ptr + ex * RN * CB * 4, al, out_ptr + row0.to(tl.int64) * N)


@triton.jit
def scale_rows(rows, e, starts, ends, E):
    """For token rows ``rows`` (of ``expert_bounds``' table): the row of each one's scales in the grouped swizzled
    layout (its expert's padded block start + its row inside the expert), and whether it belongs to an expert."""
    padded = (tl.maximum(ends - starts, 0) + 127) // 128 * 128
    shift = tl.cumsum(padded, 0) - padded - starts  # P[e] - first row of e
    owner = tl.sum(((ends[None, :] <= rows[:, None]) & (e[None, :] < E)).to(tl.int32), 1)
    srows = rows + tl.sum(tl.where(e[None, :] == owner[:, None], shift[None, :], 0), 1)
    return srows, owner < E
