"""``gemv2``: the CUDA-core NVFP4 GEMV over int64 words (one word = one whole 16-block), any M in MB-row tiles.

Per 16-block the 16 products are exact fp32 (or, with ``fp16x2``, exact fp16x2 pairs: ``numerics.fp16x2``), summed
exactly, then scaled once. A GEMV reads every weight byte once, so its time is the weight's bytes over the bandwidth
the kernel reaches: the knobs (split K, resident warps, the register cap, prefetch) are there to keep enough loads in
flight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import CudaCoreGemvConfig
from ..numerics.e2m1_e4m3 import TWO_62, TWO_64, TWO_126, e4m3_to_f32, swz_row
from ..numerics.fp16x2 import H2_UNDO, H2_UNDO_CVT, h2_block, h2_block_cvt
from ..tiles import grid_tile, k_part, pdl_wait, store_out



@triton.jit
def _nib(x, J: tl.constexpr):
    """Nibble J (0..7) of uint32 words -> e2m1 * 2**-126 (fp32): sign to bit 31, e e m to bits 24..22."""
    if J <= 5:
        e = x << (22 - 4 * J)
    else:
        e = x >> (4 * J - 22)
    return (((x << (28 - 4 * J)) & 0x80000000) | (e & 0x01C00000)).to(tl.float32, bitcast=True)


@triton.jit
def _top(c):
    return (c & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _dec8(x, PAIR: tl.constexpr):
    """The 8 nibbles of uint32 words (k order) as e2m1 * 2**-126 fp32.

    PAIR: one bit-select (a single lop3) builds a word in which two nibbles each have their sign 9 bits above their
    e e m (as in the fp32 target: bit 31 vs 24..22), so each nibble then costs one shift + one mask instead of two
    shifts, two masks and an or (~2.6 instead of ~4 integer ops per value)."""
    if PAIR:
        l6 = x << 6  # signs of nibbles 0..3 move 6 up; their e e m stay
        r6 = x >> 6  # e e m of nibbles 4..7 move 6 down; their signs stay
        c0 = (x & 0x77) | (l6 & 0xFFFFFF88)
        c1 = (x & 0x7700) | (l6 & 0xFFFF88FF)
        c2 = (r6 & 0x1DC00) | (x & 0xFFFE23FF)
        c3 = (r6 & 0x1DC0000) | (x & 0xFE23FFFF)
        return (_top(c0 << 22), _top(c0 << 18), _top(c1 << 14), _top(c1 << 10),
                _top(c2 << 12), _top(c2 << 8), _top(c3 << 4), _top(c3))
    else:
        return (_nib(x, 0), _nib(x, 1), _nib(x, 2), _nib(x, 3), _nib(x, 4), _nib(x, 5), _nib(x, 6), _nib(x, 7))


@triton.jit
def _dot8(x, y, sy, PAIR: tl.constexpr):
    """sum_j nib_j(x) * (nib_j(y) * 2**126 * sy): B nibbles x against A nibbles y (A decoded exactly, times sy)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = _dec8(x, PAIR)
    a0, a1, a2, a3, a4, a5, a6, a7 = _dec8(y, PAIR)
    s = b0 * ((a0 * TWO_126) * sy)
    s += b1 * ((a1 * TWO_126) * sy)
    s += b2 * ((a2 * TWO_126) * sy)
    s += b3 * ((a3 * TWO_126) * sy)
    s += b4 * ((a4 * TWO_126) * sy)
    s += b5 * ((a5 * TWO_126) * sy)
    s += b6 * ((a6 * TWO_126) * sy)
    s += b7 * ((a7 * TWO_126) * sy)
    return s



@triton.jit
def _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb0, kb_hi, EVEN_K: tl.constexpr):
    """Raw tiles of one K step at block kb0: B and A words (int64) and their scale bytes; all masked off (no memory
    traffic) once kb0 >= kb_hi, which the prefetch past the last step relies on."""
    kk = kb0 + t
    if EVEN_K:  # a mask constant along K keeps the loads 16-byte vectors: past the end, no row is live
        bmask = rn[:, None] < tl.where(kb0 < kb_hi, N, 0)
        amask = rm[:, None] < tl.where(kb0 < kb_hi, M, 0)
    else:
        bmask = (rn[:, None] < N) & (kk[None, :] < kb_hi)
        amask = (rm[:, None] < M) & (kk[None, :] < kb_hi)
    xb = tl.load(b_ptr + rn[:, None].to(tl.int64) * KB + kk[None, :], mask=bmask, other=0)
    sb = tl.load(sb_ptr + brow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=bmask, other=0)
    xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * KB + kk[None, :], mask=amask, other=0)
    sa = tl.load(sa_ptr + arow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=amask, other=0)
    return xb, sb, xa, sa


@triton.jit
def gemv2_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB,
                 blocks_per_split, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, PAIR: tl.constexpr,
                 SPLIT: tl.constexpr, H2: tl.constexpr = False, ASM: tl.constexpr = True, EVEN_K: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, CVT: tl.constexpr = False, PDL: tl.constexpr = False):
    """CUDA-core GEMV over int64 words (a, b viewed as int64 [rows, K/16]; one word = one 16-block, so a [BN, BKB]
    tile loads as 16-byte vectors and its scales line up one per word). Per block: 16 exact fp32 products summed
    exactly, one FMA with the B scale. MB == 1 stays 2-D; MB > 1 broadcasts [MB, 1, BKB] x [1, BN, BKB].
    H2: the products are formed two per instruction in fp16x2 (``h2_block``), still exact; ASM=False is its
    interpreter form. EVEN_K: every split is a whole number of BKB steps (the host checks), so no K mask.
    PREFETCH: double-buffer the raw tiles in registers. CVT (with H2, on SM89+): decode through e4m3 bytes and the
    hardware e4m3x2 -> f16x2 conversion; the interpreter runs the plain H2 form instead. PDL: see ``pdl_wait``."""
    pdl_wait(PDL)
    pid_k, rn, rm, t = grid_tile(BN, MB, BKB)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    gemv2_tile(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB, rm, rn, t, kb_lo, kb_hi,
               MB, BN, BKB, PAIR, SPLIT, H2, ASM, EVEN_K, PREFETCH, CVT)


@triton.jit
def gemv2_tile(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB, rm, rn, t, kb_lo,
               kb_hi, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, PAIR: tl.constexpr, SPLIT: tl.constexpr,
               H2: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
               CVT: tl.constexpr):
    """One output tile (rows ``rm`` of A, rows ``rn`` of B) over K blocks [kb_lo, kb_hi): ``gemv2_kernel``'s work,
    shared with the grouped GEMV (``gemv/cuda_core_grouped``), which hands it one expert's operands."""
    # swizzled column offset of block t (kb0 % 4 == 0); written so that pairs of blocks look contiguous, like the
    # 2-word vectors of the data tile, so both loads get the same register layout
    scol = (t // 4) * 512 + ((t % 4) // 2) * 2 + t % 2
    brow = swz_row(rn, CB)
    arow = swz_row(rm, CB)
    if MB == 1:
        acc = tl.zeros((BN, BKB), dtype=tl.float32)
    else:
        acc = tl.zeros((MB, BN, BKB), dtype=tl.float32)
    # PREFETCH: the next K step's raw tiles are loaded before this step's math (register double buffer), so a
    # warp keeps loads in flight while it decodes; Triton does not pipeline loads that feed no tl.dot
    if PREFETCH:
        nb, nsb, na, nsa = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb_lo,
                                     kb_hi, EVEN_K)
    for kb0 in range(kb_lo, kb_hi, BKB):
        if PREFETCH:
            xb, sbr, xa, sar = nb, nsb, na, nsa
            nb, nsb, na, nsa = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB,
                                         kb0 + BKB, kb_hi, EVEN_K)
        else:
            xb, sbr, xa, sar = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb0,
                                         kb_hi, EVEN_K)
        sb = e4m3_to_f32(sbr)
        sa = e4m3_to_f32(sar)
        if MB > 1:
            xb = xb[None, :, :]
            sb = sb[None, :, :]
            xa = xa[:, None, :]
            sa = sa[:, None, :]
        if H2:
            b_lo, b_hi = xb.to(tl.uint32), (xb >> 32).to(tl.uint32)
            a_lo, a_hi = xa.to(tl.uint32), (xa >> 32).to(tl.uint32)
            if CVT and ASM:
                s = h2_block_cvt(b_lo, b_hi, a_lo, a_hi)
            else:
                s = h2_block(b_lo, b_hi, a_lo, a_hi, ASM)
            acc += s * (sb * sa)
        else:
            sa = sa * TWO_64
            s = _dot8(xb.to(tl.uint32), xa.to(tl.uint32), sa, PAIR)
            s += _dot8((xb >> 32).to(tl.uint32), (xa >> 32).to(tl.uint32), sa, PAIR)
            acc += s * sb
    if H2 and CVT and ASM:
        undo = H2_UNDO_CVT
    elif H2:
        undo = H2_UNDO
    else:
        undo = TWO_62
    if MB == 1:
        res = tl.sum(acc, axis=1)[None, :] * undo
    else:
        res = tl.sum(acc, axis=2) * undo
    store_out(res, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: CudaCoreGemvConfig) -> None:
    """Launch ``gemv2_kernel`` on canonical operands (scales as uint8): an (N tile, K part, M tile) grid; the last
    CTA of a tile sums the K parts (``workspace``)."""
    m, n, kb = a.shape[0], b.shape[0], a.shape[1] // 8
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, cfg.block_n), split, runtime.cdiv(m, cfg.rows))
    ws, cnt = workspace.buffers(m, n, split, grid[0] * grid[2], out.device) if split > 1 else (out, out)
    # int64 views: one word = one 16-block (K % 16 == 0); a misaligned view raises here, so the tuner skips it
    runtime.launch(gemv2_kernel, grid, a.view(torch.int64), b.view(torch.int64), sa, sb, alpha, out, ws, cnt, m, n, kb,
                   runtime.cdiv(kb, 4), per, MB=cfg.rows, BN=cfg.block_n, BKB=cfg.k_blocks, PAIR=cfg.pair_decode,
                   SPLIT=split > 1, H2=cfg.fp16x2, ASM=not runtime.jit_interpreted(), EVEN_K=kb % cfg.k_blocks == 0,
                   PREFETCH=cfg.prefetch, CVT=cfg.e4m3x2_convert, num_warps=cfg.warps, num_stages=cfg.stages,
                   **runtime.register_cap(cfg.max_registers), **runtime.pdl(out.device, cfg.pdl))
