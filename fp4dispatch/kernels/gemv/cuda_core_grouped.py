"""``gemv/cuda_core_grouped``: ``fp4_grouped_mm`` for decode batches, the CUDA-core GEMV of ``gemv/cuda_core`` per
expert, in one launch.

A decode step routes each token to top-k of many experts, so a touched expert holds one row or a few, and the call
is a GEMV per touched expert: its time is the touched experts' weight bytes over the bandwidth reached. Grid (N
tiles, 1, M tiles of the grouped grid): each CTA finds its expert's ``rows``-row tile from ``offs`` on the GPU
(``expert_rows.expert_tile``), then runs ``gemv2_tile`` on that expert's rows, weight and scales over the whole
K (no split: the touched experts already make enough CTAs). An expert without rows costs nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..config_grouped import GemvGroupedConfig
from ..expert_rows import expert_operands, expert_tile
from .cuda_core import gemv2_tile


@triton.jit
def grouped_gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, offs_ptr, T, N, KB, CB, RN, E,
                        ALPHA_E: tl.constexpr, EP: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                        BKB: tl.constexpr, H2: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                        PREFETCH: tl.constexpr, CVT: tl.constexpr):
    """a, b as int64 words (one word = one 16-block); one (expert's M tile, N tile) of the grouped product."""
    expert, row0, rows, pad0, local0 = expert_tile(offs_ptr, tl.program_id(2), T, E, MB, EP)
    if local0 < rows:
        a_e, b_e, sa_e, sb_e, al, out_e = expert_operands(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, expert,
                                                          row0, pad0, N, KB, CB, RN, ALPHA_E)
        gemv2_tile(a_e, b_e, sa_e, sb_e, al, out_e, out_e, out_e, rows, N, KB, CB, local0 + tl.arange(0, MB),
                   tl.program_id(0) * BN + tl.arange(0, BN), tl.arange(0, BKB), 0, KB, MB, BN, BKB, True, False, H2,
                   ASM, EVEN_K, PREFETCH, CVT)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        offs: torch.Tensor, cfg: GemvGroupedConfig) -> None:
    """Launch ``grouped_gemv_kernel`` on canonical grouped operands (scales as uint8)."""
    t, kb = a.shape[0], a.shape[1] // 8
    e, n = b.shape[0], b.shape[1]
    grid = (runtime.cdiv(n, cfg.block_n), 1, runtime.cdiv(t, cfg.rows) + min(e, t))
    runtime.launch(grouped_gemv_kernel, grid, a.view(torch.int64), b.view(torch.int64), sa, sb, alpha, out, offs, t, n,
                   kb, runtime.cdiv(kb, 4), runtime.cdiv(n, 128) * 128, e, ALPHA_E=alpha.numel() > 1,
                   EP=max(16, triton.next_power_of_2(e)), MB=cfg.rows, BN=cfg.block_n, BKB=cfg.k_blocks,
                   H2=cfg.fp16x2, ASM=not runtime.jit_interpreted(), EVEN_K=kb % cfg.k_blocks == 0,
                   PREFETCH=cfg.prefetch, CVT=cfg.e4m3x2_convert, num_warps=cfg.warps, num_stages=cfg.stages,
                   **runtime.register_cap(cfg.max_registers))
