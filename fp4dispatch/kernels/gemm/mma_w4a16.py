"""``w4a16`` GEMM on 16-bit tensor cores, any M: ``out = alpha * a @ dequant(b).T`` with a bf16/fp16 as given.

The weight is decoded in registers (``gemv/cuda_core_w4a16.weight_pairs``: exact values times 2**-9) and cast to the
activations' dtype, which holds every such value exactly (bf16 by its range, fp16 because the smallest, 2**-19,
is a whole number of its 2**-24 subnormal steps and no value needs more than 6 significant bits); even-k and odd-k
halves go to two ``tl.dot`` so that no interleave is needed. fp32 accumulation; split-K over ``program_id(1)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import MmaW4A16Config
from ..gemv.cuda_core_w4a16 import weight_pairs
from ..tiles import grouped_tile, k_part, store_out


@triton.jit
def mma_w4a16_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
                     blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    """Tiles [BM, BN], M tiles grouped by GROUP_M for L2 reuse; DOT_F32 (the interpreter): fp32 dots."""
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    K = 2 * K2
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        acc = w4a16_step(acc, a_ptr, rm, M, K, b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BM, BKB, DOT_F32)
    store_out(acc * 512.0, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


@triton.jit
def w4a16_step(acc, a_ptr, rm, M, K, b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BM: tl.constexpr, BKB: tl.constexpr,
               DOT_F32: tl.constexpr):
    """One K step of a [BM, BN] tile: rows ``rm`` of the 16-bit A [M, K] as they are, times the weight rows ``rn``
    decoded (exact values times 2**-9) to A's dtype; even-k and odd-k halves to two ``tl.dot`` into ``acc``."""
    kk = kb0 * 16 + tl.arange(0, BKB * 16)
    mask = (rm[:, None] < M) & (kk[None, :] < kb_hi * 16)
    x = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + kk[None, :], mask=mask, other=0.0)
    w_lo, w_hi = weight_pairs(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB)
    if DOT_F32:
        x = x.to(tl.float32)
    else:
        w_lo = w_lo.to(x.dtype)
        w_hi = w_hi.to(x.dtype)
    x_lo, x_hi = tl.split(tl.reshape(x, (BM, BKB * 8, 2)))
    acc = tl.dot(x_lo, tl.trans(w_lo), acc)
    return tl.dot(x_hi, tl.trans(w_hi), acc)


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: MmaW4A16Config) -> None:
    """Launch ``mma_w4a16_kernel``: a (bf16/fp16 [M, K]), b uint8 [N, K/2], sb its swizzled scales as uint8."""
    (m, k), n = a.shape, b.shape[0]
    kb = k // 16
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(m, cfg.block_m) * runtime.cdiv(n, cfg.block_n), split)
    ws, cnt = workspace.buffers(m, n, split, grid[0], out.device) if split > 1 else (out, out)
    runtime.launch(mma_w4a16_kernel, grid, a, b, sb, alpha, out, ws, cnt, m, n, k // 2, kb, runtime.cdiv(kb, 4), per,
                   BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks, GROUP_M=cfg.group_m, SPLIT=split > 1,
                   DOT_F32=runtime.jit_interpreted(), num_warps=cfg.warps, num_stages=cfg.stages)
