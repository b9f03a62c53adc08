"""``gemv``: the byte-wise CUDA-core NVFP4 GEMV for M <= MB (no tensor-core padding to 16 rows), the first and
simplest kernel; offered only where ``wgmma_register_a`` is not (before SM89), after ``cuda_core``'s word-wise GEMV.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import BytewiseGemvConfig
from ..numerics.e2m1_e4m3 import TWO_62, TWO_64, TWO_126, load_block_bytes, nib_hi, nib_lo, per_byte
from ..tiles import k_part, store_out

@triton.jit
def gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
                blocks_per_split, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr):
    """CUDA-core GEMV for M <= MB (no tensor-core padding to 16 rows): per 16-block, the exact fp32 sum of 16
    nibble products, times the B block scale, accumulated elementwise; one reduction after the K loop."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, MB)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    BK2: tl.constexpr = BKB * 8
    acc = tl.zeros((MB, BN, BKB), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        ub, sb = load_block_bytes(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB)
        ua, sa = load_block_bytes(a_ptr, sa_ptr, rm, M, kb0, kb_hi, K2, CB, BKB)
        # A as exact values * 2**64: (nibble * 2**-126) * A is then an fp32 normal, and the 16-term sum is exact
        sa2 = per_byte(sa * TWO_64, BK2)
        a_lo = (nib_lo(ua) * TWO_126) * sa2
        a_hi = (nib_hi(ua) * TWO_126) * sa2
        prod = nib_lo(ub)[None, :, :] * a_lo[:, None, :] + nib_hi(ub)[None, :, :] * a_hi[:, None, :]
        part = tl.sum(tl.reshape(prod, (MB, BN, BKB, 8)), axis=3)
        acc += part * sb[None, :, :]
    res = tl.sum(acc, axis=2) * TWO_62
    store_out(res, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)



def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: BytewiseGemvConfig) -> None:
    """Launch ``gemv_kernel`` on canonical operands (scales as uint8): an (N tile, K part) grid."""
    (m, k2), n = a.shape, b.shape[0]
    kb = k2 // 8
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, cfg.block_n), split)
    ws, cnt = workspace.buffers(m, n, split, grid[0], out.device) if split > 1 else (out, out)
    runtime.launch(gemv_kernel, grid, a, b, sa, sb, alpha, out, ws, cnt, m, n, k2, kb, runtime.cdiv(kb, 4), per,
                   MB=cfg.rows, BN=cfg.block_n, BKB=cfg.k_blocks, SPLIT=split > 1, num_warps=cfg.warps)
