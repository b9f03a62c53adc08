"""``mma_grouped``: ``fp4_grouped_mm`` (the MoE expert GEMM) in one launch, for GPUs without FP4 tensor cores.

Grid (N tiles, M tiles): M tile ``t`` belongs to the expert whose tiles cover it, found by every CTA from ``offs``
on the GPU (a prefix sum over the E experts' tile counts in registers: no host sync, so a CUDA graph captured once
serves any routing). The grid has room for the most tiles any routing of T rows can make, ``cdiv(T, BM) +
min(E, T)``; CTAs past the last tile return at once, so an expert with no rows costs nothing. Inside a tile the work
is ``mma_bf16``'s: both operands decoded in registers to bf16 (exact), even-k and odd-k halves, two ``tl.dot`` per
K step, fp32 accumulation in a fixed order (deterministic), alpha (per expert or one) in fp32 at the end.

Scales are read in the grouped swizzled layout (``format_grouped``, docs/contract.md): expert e's activation scales
start at padded row ``sum_{j<e} round_up(rows_j, 128)``, and each expert's weight scales are their own 128x4-swizzled
matrix, so a tile's scale addresses are the dense kernel's plus one offset per expert. ``offs`` is clamped to
[0, T] and made non-decreasing in the kernel, so a wrong routing table cannot make it read or write out of bounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..config_grouped import MmaGroupedConfig
from ..expert_rows import expert_operands, expert_tile
from ..numerics.e2m1_e4m3 import TWO_18, decoded_halves
from ..tiles import store_out


@triton.jit
def grouped_mma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, offs_ptr, T, N, K2, KB, CB, RN, E,
                       ALPHA_E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BKB: tl.constexpr, DOT_F32: tl.constexpr):
    """One (expert's M tile, N tile) of out = alpha[e] * A[rows of e] @ B[e].T."""
    expert, row0, rows, pad0, local0 = expert_tile(offs_ptr, tl.program_id(1), T, E, BM, EP)
    if local0 < rows:
        a_e, b_e, sa_e, sb_e, al, out_e = expert_operands(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, expert,
                                                          row0, pad0, N, K2, CB, RN, ALPHA_E)
        rm = local0 + tl.arange(0, BM)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb0 in range(0, KB, BKB):
            a_lo, a_hi = decoded_halves(a_e, sa_e, rm, rows, kb0, KB, K2, CB, BKB, DOT_F32)
            b_lo, b_hi = decoded_halves(b_e, sb_e, rn, N, kb0, KB, K2, CB, BKB, DOT_F32)
            acc = tl.dot(a_lo, tl.trans(b_lo), acc)
            acc = tl.dot(a_hi, tl.trans(b_hi), acc)
        store_out(acc * TWO_18, rm, rn, rows, N, al, out_e, out_e, out_e, False)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        offs: torch.Tensor, cfg: MmaGroupedConfig) -> None:
    """Launch ``grouped_mma_kernel`` on canonical grouped operands (scales as uint8)."""
    t, k2 = a.shape
    e, n, _ = b.shape
    kb = k2 // 8
    grid = (runtime.cdiv(n, cfg.block_n), runtime.cdiv(t, cfg.block_m) + min(e, t))
    runtime.launch(grouped_mma_kernel, grid, a, b, sa, sb, alpha, out, offs, t, n, k2, kb, runtime.cdiv(kb, 4),
                   runtime.cdiv(n, 128) * 128, e, ALPHA_E=alpha.numel() > 1, EP=max(16, triton.next_power_of_2(e)),
                   BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks, DOT_F32=runtime.jit_interpreted(),
                   num_warps=cfg.warps, num_stages=cfg.stages)
