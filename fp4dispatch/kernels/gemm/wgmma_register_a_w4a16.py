"""``w4a16`` GEMM with the weight as the register operand (``WgmmaRegisterAW4A16Config``, SM89+; on SM90 the first
``w4a16_mm`` candidates): ``gemm/wgmma_register_a``'s tile with 16-bit activations.

``acc[BN, BM] = W @ A.T``. The weight is decoded by ``wgmma_register_a._dec16`` straight into the wgmma operand
layout, in the activations' dtype: fp16 by bit placement and ``mul.rn.f16x2``, bf16 by ``numerics/bf16x2.py``; both
give ``e2m1 * e4m3 * 2**-7``, exact. The decode's K order is a fixed permutation within each group of 4 blocks
(``wgmma_register_a.to_k_order``), so a small kernel first writes the activations in that order (``permute_a``:
a copy, no decode); every N tile's CTAs then load whole rows of it, as ``wgmma_register_a`` loads its pre-decoded A
(gathering them in the loop, or permuting them in registers there, was slower: docs/kernels.md). Each product of a
bf16/fp16 activation and a weight value is exact in the fp32 accumulator; the epilogue multiplies by 2**7 (exact),
then alpha. Under the interpreter (no PTX) the weight values are formed in fp32 and the dot runs in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import WgmmaRegisterAW4A16Config
from ..numerics.e2m1_e4m3 import swz_row
from ..tiles import (gdc_launch_dependents, grid_tile, k_part, pdl_wait, store_out, stream_piece, stream_range,
                     stream_store)
from .wgmma_register_a import _dec16, _scale_cols, k_order_width, stream_grid, to_k_order

W4A16_UNDO = tl.constexpr(128.0)  # 2**7: undoes the weight values' 2**-7


@triton.jit
def register_a_w4a16_tile(a_ptr, LDA, rm, M, KB, b_ptr, sb_ptr, rn, N, kb_lo, kb_hi, CB, BM: tl.constexpr,
                          BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr):
    """out tile [BM, BN] (fp32, before alpha) of activation rows ``rm`` (< M) of the 16-bit a, already in the decode's
    K order (``permute_a``; row stride LDA), by weight rows ``rn`` (< N) of b (int64 words [N, K/16], swizzled scale
    bytes at ``sb_ptr``; KB = K/16, an argument so that its divisibility reaches the compiler: computed from K in
    here, the weight loads lose their 16-byte width and the scale loads their pipelining), over 16-blocks
    [kb_lo, kb_hi) (kb_lo a multiple of BKB). Also the tile of ``mma_w4a16_grouped``'s register-operand form."""
    t = tl.arange(0, BKB)
    scol = _scale_cols(t)
    brow = swz_row(rn, CB)
    k_end = (kb_hi + 3) // 4 * 64  # the last group's padding columns hold zeros
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        kk = kb0 + t
        bmask = (rn[:, None] < N) & (kk[None, :] < kb_hi)
        xb = tl.load(b_ptr + rn[:, None].to(tl.int64) * KB + kk[None, :], mask=bmask, other=0)
        sb = tl.load(sb_ptr + brow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=bmask, other=0)
        k = kb0 * 16 + tl.arange(0, BKB * 16)
        xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * LDA + k[None, :],
                     mask=(rm[:, None] < M) & (k[None, :] < k_end), other=0.0)
        if not ASM:
            xa = xa.to(tl.float32)
        acc = tl.dot(_dec16(xb, sb, BKB, ASM, BF16=BF16), tl.trans(xa), acc)
    return tl.trans(acc * W4A16_UNDO)


@triton.jit
def permute_a_kernel(a_ptr, ad_ptr, M, K, KP, BR: tl.constexpr, BKB: tl.constexpr, PDL: tl.constexpr = False,
                     EARLY: tl.constexpr = False):
    """a [M, K] (16-bit, K order) -> ad [M, KP] (KP: K padded to whole groups of 4 blocks) in the decode's K order
    (``to_k_order``), zeros past K; BKB a multiple of 4. EARLY: as ``wgmma_register_a.wmma_prep_a_kernel``'s."""
    pdl_wait(PDL)
    if PDL and EARLY:
        gdc_launch_dependents()
    rm = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.program_id(1) * BKB * 16 + tl.arange(0, BKB * 16)
    x = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                other=0.0)
    tl.store(ad_ptr + rm[:, None].to(tl.int64) * KP + k[None, :], to_k_order(x, BKB),
             mask=(rm[:, None] < M) & (k[None, :] < KP))


@triton.jit
def wmma_w4a16_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, LDA, CB,
                      blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr,
                      ASM: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Tile [BN, BM] of out.T per CTA over an (N tile, K part, M tile) grid: b viewed as int64 words [N, K/16], a the
    16-bit activations in the decode's K order (BF16: bfloat16; row stride LDA); SPLIT: the tile's last CTA sums
    (``store_out``). PDL: ``pdl_wait``."""
    pdl_wait(PDL)
    pid_k, rn, rm, _ = grid_tile(BN, BM, BKB)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    acc = register_a_w4a16_tile(a_ptr, LDA, rm, M, KB, b_ptr, sb_ptr, rn, N, kb_lo, kb_hi, CB, BM, BN, BKB, ASM, BF16)
    store_out(acc, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


@triton.jit
def wmma_w4a16_sk_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, LDA, CB, NT, TILES,
                         STEPS, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
                         BF16: tl.constexpr, PDL: tl.constexpr = False):
    """``wmma_w4a16_kernel`` with stream-K (``tiles.stream_range``: one equal range of all tiles' K steps per CTA, a
    tile cut between CTAs summed in CTA order, deterministic), as ``wgmma_register_a.wmma_sk_kernel``."""
    pdl_wait(PDL)
    c, p, total, it, hi = stream_range(TILES, STEPS)
    while it < hi:
        tile, start, s0, s1, rn, rm = stream_piece(it, hi, STEPS, NT, BN, BM)
        acc = register_a_w4a16_tile(a_ptr, LDA, rm, M, KB, b_ptr, sb_ptr, rn, N, s0 * BKB, tl.minimum(s1 * BKB, KB),
                                    CB, BM, BN, BKB, ASM, BF16)
        stream_store(acc, tile, start, STEPS, total, c, p, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr)
        it = start + s1


def permute_a(a: torch.Tensor, pdl: dict) -> tuple[torch.Tensor, int]:
    """16-bit activations a [M, K] in the decode's K order, written by ``permute_a_kernel`` to workspace scratch, and
    its row stride (K padded to whole groups of 4 blocks). ``pdl``: the launch options (``runtime.pdl``'s, or
    ``wgmma_register_a.pdl_after_predecode``'s first)."""
    (m, k), br, bkb = a.shape, 16, 16
    kp = k_order_width(k)
    ad = workspace.scratch("permute_a", (m, kp), a.dtype, a.device)
    runtime.launch(permute_a_kernel, (runtime.cdiv(m, br), runtime.cdiv(kp, bkb * 16)), a, ad, m, k, kp, BR=br,
                   BKB=bkb, num_warps=4, **pdl)
    return ad, kp


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaRegisterAW4A16Config) -> None:
    """Launch ``permute_a_kernel``, then ``wmma_w4a16_kernel`` (an (N tile, K part, M tile) grid) or, with
    ``stream_k``, ``wmma_w4a16_sk_kernel`` (one wave of CTAs): a (bf16/fp16 [M, K], contiguous), b uint8 [N, K/2],
    sb its swizzled scales as uint8."""
    (m, k), n = a.shape, b.shape[0]
    kb = k // 16
    pdl = runtime.pdl(out.device, cfg.pdl)
    opts = dict(BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks, ASM=not runtime.jit_interpreted(),
                BF16=a.dtype == torch.bfloat16, num_warps=cfg.warps, num_stages=cfg.stages,
                **runtime.register_cap(cfg.max_registers), **pdl)
    ops, lda = permute_a(a, pdl)
    if cfg.stream_k and runtime.cdiv(kb, cfg.k_blocks) > 1:  # else the tile-per-CTA kernel: wgmma_register_a.STEPS_NOTE
        nt, tiles, steps, ctas, ws, cnt = stream_grid(m, n, kb, cfg, out)
        runtime.launch(wmma_w4a16_sk_kernel, (ctas,), ops, b.view(torch.int64), sb, alpha, out, ws, cnt, m, n, kb,
                       lda, runtime.cdiv(kb, 4), nt, tiles, steps, **opts)
        return
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, cfg.block_n), split, runtime.cdiv(m, cfg.block_m))
    ws, cnt = workspace.buffers(m, n, split, grid[0] * grid[2], out.device) if split > 1 else (out, out)
    runtime.launch(wmma_w4a16_kernel, grid, ops, b.view(torch.int64), sb, alpha, out, ws, cnt, m, n, kb, lda,
                   runtime.cdiv(kb, 4), per, SPLIT=split > 1, **opts)
