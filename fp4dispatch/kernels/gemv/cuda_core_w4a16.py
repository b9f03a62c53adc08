"""``w4a16`` GEMV on CUDA cores: ``out = alpha * a @ dequant(b).T`` for a few rows of bf16/fp16 activations.

The activations are read as they are (no decode, no quantize); the weight's nibbles are placed into fp32 words and
multiplied by their block scale (bit placement, ``numerics/e2m1_e4m3.py``), scaled by 2**-9 so that the e4m3 scale
times 2**117 stays an fp32 normal. Every activation x weight product is exact in fp32 (8 or 11 significant bits
times at most 6); the sums are fp32, the epilogue multiplies by 2**9 (exact) and alpha, then casts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..config import CudaCoreW4A16Config
from ..numerics.e2m1_e4m3 import TWO_117, load_block_bytes, nib_hi, nib_lo, per_byte
from ..tiles import k_part, store_out


@triton.jit
def activation_pairs(a_ptr, rows, M, K, k0, k_hi, BK2: tl.constexpr):
    """Even-k and odd-k halves [R, BK2] of activation rows ``rows``, columns k0 .. k0 + 2*BK2 (below k_hi), fp32."""
    kk = k0 + tl.arange(0, 2 * BK2)
    mask = (rows[:, None] < M) & (kk[None, :] < k_hi)
    x = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (x.shape[0], BK2, 2)))


@triton.jit
def weight_pairs(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB: tl.constexpr):
    """Even-k and odd-k halves [BN, BKB*8] of the weight rows ``rn``, exact fp32 values times 2**-9."""
    u, s = load_block_bytes(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB)
    s2 = per_byte(s * TWO_117, BKB * 8)
    return nib_lo(u) * s2, nib_hi(u) * s2


@triton.jit
def gemv_w4a16_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
                      blocks_per_split, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (N tiles, K parts, M tiles): MB activation rows x BN weight rows per program; products summed over the
    K step, one row sum per step."""
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(2) * MB + tl.arange(0, MB)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    acc = tl.zeros((MB, BN), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        w_lo, w_hi = weight_pairs(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB)
        x_lo, x_hi = activation_pairs(a_ptr, rm, M, 2 * K2, kb0 * 16, kb_hi * 16, BKB * 8)
        prod = x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
        acc += tl.sum(prod, axis=2)
    store_out(acc * 512.0, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: CudaCoreW4A16Config) -> None:
    """Launch ``gemv_w4a16_kernel``: a (bf16/fp16 [M, K]), b uint8 [N, K/2], sb its swizzled scales as uint8."""
    (m, k), n = a.shape, b.shape[0]
    kb = k // 16
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, cfg.block_n), split, runtime.cdiv(m, cfg.rows))
    ws, cnt = workspace.buffers(m, n, split, grid[0] * grid[2], out.device) if split > 1 else (out, out)
    runtime.launch(gemv_w4a16_kernel, grid, a, b, sb, alpha, out, ws, cnt, m, n, k // 2, kb, runtime.cdiv(kb, 4),
                   per, MB=cfg.rows, BN=cfg.block_n, BKB=cfg.k_blocks, SPLIT=split > 1, num_warps=cfg.warps)
