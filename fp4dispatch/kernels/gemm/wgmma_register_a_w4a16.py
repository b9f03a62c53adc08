"""``w4a16`` GEMM with the weight as the register operand (``WgmmaRegisterAW4A16Config``, SM89+; on SM90 the first
``w4a16_mm`` candidates up to M = 512): ``gemm/wgmma_register_a``'s tile with 16-bit activations read as they are.

``acc[BN, BM] = W @ A.T``. The weight is decoded by ``wgmma_register_a._dec16`` straight into the wgmma operand
layout, in the activations' dtype: fp16 by bit placement and ``mul.rn.f16x2``, bf16 by ``numerics/bf16x2.py``; both
give ``e2m1 * e4m3 * 2**-7``, exact. The decode's K order is a fixed permutation within each group of 4 blocks
(``k_of_column``), so the activation tile is taken in that order: gathered at those offsets (``gather_a``), or
loaded in K order and permuted in registers. No activation decode and no second launch. Each product of a bf16/fp16
activation and a weight value is exact in the fp32 accumulator; the epilogue multiplies by 2**7 (exact), then alpha.
Under the interpreter (no PTX) the weight values are formed in fp32 and the dot runs in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import WgmmaRegisterAW4A16Config
from ..numerics.e2m1_e4m3 import swz_row
from ..tiles import grid_tile, pdl_wait, store_out
from .wgmma_register_a import _dec16, _scale_cols, k_of_column, to_k_order

W4A16_UNDO = tl.constexpr(128.0)  # 2**7: undoes the weight values' 2**-7


@triton.jit
def register_a_w4a16_tile(a_ptr, rm, M, K, b_ptr, sb_ptr, rn, N, kb_lo, kb_hi, CB, BM: tl.constexpr,
                          BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr,
                          GATHER: tl.constexpr):
    """out tile [BM, BN] (fp32, before alpha) of activation rows ``rm`` (< M) of the 16-bit a [M, K] by weight rows
    ``rn`` (< N) of b (int64 words [N, K/16], swizzled scale bytes at ``sb_ptr``), over 16-blocks [kb_lo, kb_hi)
    (kb_lo a multiple of BKB). Also the tile of ``mma_w4a16_grouped``'s register-operand form."""
    t = tl.arange(0, BKB)
    KB = K // 16
    scol = _scale_cols(t)
    brow = swz_row(rn, CB)
    if GATHER:
        cols = k_of_column(BKB)
    else:
        cols = tl.arange(0, BKB * 16)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        kk = kb0 + t
        bmask = (rn[:, None] < N) & (kk[None, :] < kb_hi)
        xb = tl.load(b_ptr + rn[:, None].to(tl.int64) * KB + kk[None, :], mask=bmask, other=0)
        sb = tl.load(sb_ptr + brow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=bmask, other=0)
        k = kb0 * 16 + cols
        xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + k[None, :],
                     mask=(rm[:, None] < M) & (k[None, :] < kb_hi * 16), other=0.0)
        if not GATHER:
            xa = to_k_order(xa, BKB)
        if not ASM:
            xa = xa.to(tl.float32)
        acc = tl.dot(_dec16(xb, sb, BKB, ASM, BF16=BF16), tl.trans(xa), acc)
    return tl.trans(acc * W4A16_UNDO)


@triton.jit
def wmma_w4a16_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, CB,
                      blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr,
                      ASM: tl.constexpr, BF16: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr = False):
    """Tile [BN, BM] of out.T per CTA over an (N tile, K part, M tile) grid: b viewed as int64 words [N, K/16], a the
    16-bit activations [M, K] (BF16: bfloat16); SPLIT: the tile's last CTA sums (``store_out``). PDL: ``pdl_wait``."""
    pdl_wait(PDL)
    pid_k, rn, rm, _ = grid_tile(BN, BM, BKB)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, K // 16)
    acc = register_a_w4a16_tile(a_ptr, rm, M, K, b_ptr, sb_ptr, rn, N, kb_lo, kb_hi, CB, BM, BN, BKB, ASM, BF16,
                                GATHER)
    store_out(acc, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaRegisterAW4A16Config) -> None:
    """Launch ``wmma_w4a16_kernel``: a (bf16/fp16 [M, K], contiguous), b uint8 [N, K/2], sb its swizzled scales as
    uint8."""
    (m, k), n = a.shape, b.shape[0]
    kb = k // 16
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, cfg.block_n), split, runtime.cdiv(m, cfg.block_m))
    ws, cnt = workspace.buffers(m, n, split, grid[0] * grid[2], out.device) if split > 1 else (out, out)
    runtime.launch(wmma_w4a16_kernel, grid, a, b.view(torch.int64), sb, alpha, out, ws, cnt, m, n, k,
                   runtime.cdiv(kb, 4), per, BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks, SPLIT=split > 1,
                   ASM=not runtime.jit_interpreted(), BF16=a.dtype == torch.bfloat16, GATHER=cfg.gather_a,
                   num_warps=cfg.warps, num_stages=cfg.stages, **runtime.register_cap(cfg.max_registers),
                   **runtime.pdl(out.device, cfg.pdl))
