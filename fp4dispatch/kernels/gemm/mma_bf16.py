"""``mma``: the bf16 tensor-core NVFP4 GEMM, any M (the fallback before SM89, where ``wgmma_register_a`` is not
offered). Both operands are decoded in registers to bf16 (exact: every e2m1 x e4m3 value fits), split into even-k and
odd-k halves so that two ``tl.dot`` need no interleave; fp32 accumulation, split-K over ``program_id(1)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import MmaBf16Config
from ..numerics.e2m1_e4m3 import TWO_18, decoded_halves
from ..tiles import grouped_tile, k_part, store_out


@triton.jit
def mma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
               blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, GROUP_M: tl.constexpr,
               SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    """Tiled tensor-core GEMM: decode both operands in registers, bf16 dot, fp32 accumulate; split-K by
    program_id(1) (SPLIT: reduced by the tile's last CTA, see ``store_out``) or a direct alpha+cast epilogue."""
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        a_lo, a_hi = decoded_halves(a_ptr, sa_ptr, rm, M, kb0, kb_hi, K2, CB, BKB, DOT_F32)
        b_lo, b_hi = decoded_halves(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB, DOT_F32)
        acc = tl.dot(a_lo, tl.trans(b_lo), acc)
        acc = tl.dot(a_hi, tl.trans(b_hi), acc)
    store_out(acc * TWO_18, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)



def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: MmaBf16Config) -> None:
    """Launch ``mma_kernel`` on canonical operands (scales as uint8): a (tile, K part) grid, M tiles grouped by
    ``group_m`` for L2 reuse."""
    (m, k2), n = a.shape, b.shape[0]
    kb = k2 // 8
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(m, cfg.block_m) * runtime.cdiv(n, cfg.block_n), split)
    ws, cnt = workspace.buffers(m, n, split, grid[0], out.device) if split > 1 else (out, out)
    runtime.launch(mma_kernel, grid, a, b, sa, sb, alpha, out, ws, cnt, m, n, k2, kb, runtime.cdiv(kb, 4), per,
                   BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks, GROUP_M=cfg.group_m, SPLIT=split > 1,
                   DOT_F32=runtime.jit_interpreted(), num_warps=cfg.warps, num_stages=cfg.stages)
