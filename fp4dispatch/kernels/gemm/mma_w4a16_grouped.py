"""``mma_w4a16_grouped``: ``w4a16_grouped_mm`` (the MoE expert GEMM with bf16/fp16 activations as they are) in one
launch, for GPUs without FP4 tensor cores.

The grid and the expert lookup are ``mma_grouped``'s (``expert_rows.expert_tile``: each CTA finds its expert's M tile
from ``offs`` on the GPU, no host sync, an expert without rows costs nothing); inside a tile the work is
``mma_w4a16``'s (the activations loaded as they are, the weight decoded in registers to exact values times 2**-9 in
the activations' dtype, even-k and odd-k halves to two ``tl.dot``) or, with ``register_a``,
``wgmma_register_a_w4a16``'s (the weight decoded into the register operand, the activations permuted first, or the
NVFP4 tokens decoded in that order); fp32
sums in a fixed order (no split-K: deterministic), alpha (per expert or one) in fp32 at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime, workspace
from ..dequant import dequantize_grouped_rows
from ..config_grouped import MmaW4A16GroupedConfig
from ..expert_rows import expert_operands, expert_tile
from ..tiles import store_out
from .mma_w4a16 import w4a16_step
from .wgmma_register_a_w4a16 import k_order_width, permute_a, register_a_w4a16_tile


@triton.jit
def grouped_w4a16_kernel(a_ptr, b_ptr, sb_ptr, alpha_ptr, out_ptr, offs_ptr, T, N, K2, KB, CB, RN, E, LDA,
                         ALPHA_E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BKB: tl.constexpr, DOT_F32: tl.constexpr, REG_A: tl.constexpr = False,
                         BF16: tl.constexpr = False):
    """One (expert's M tile, N tile) of out = alpha[e] * A[rows of e] @ dequant(B[e]).T, A 16-bit [T, K] (row stride
    LDA). REG_A: the tile of ``wgmma_register_a_w4a16`` (the weight as the register operand, A in its decode's K
    order; BF16: A is bfloat16)."""
    expert, row0, rows, pad0, local0 = expert_tile(offs_ptr, tl.program_id(1), T, E, BM, EP)
    if local0 < rows:
        _, b_e, _, sb_e, al, out_e = expert_operands(a_ptr, b_ptr, sb_ptr, sb_ptr, alpha_ptr, out_ptr, expert,
                                                     row0, pad0, N, K2, CB, RN, ALPHA_E)
        K = 2 * K2
        a_e = a_ptr + row0.to(tl.int64) * LDA
        rm = local0 + tl.arange(0, BM)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        if REG_A:
            acc = register_a_w4a16_tile(a_e, LDA, rm, rows, KB, b_e.to(tl.pointer_type(tl.int64)), sb_e, rn, N, 0,
                                        KB, CB, BM, BN, BKB, not DOT_F32, BF16)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb0 in range(0, KB, BKB):
                acc = w4a16_step(acc, a_e, rm, rows, K, b_e, sb_e, rn, N, kb0, KB, K2, CB, BM, BKB, DOT_F32)
            acc = acc * 512.0
        store_out(acc, rm, rn, rows, N, al, out_e, out_e, out_e, False)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        offs: torch.Tensor, cfg: MmaW4A16GroupedConfig) -> None:
    """Launch ``grouped_w4a16_kernel``: a bf16/fp16 [T, K] (``sa`` unused: the grouped launchers' signature), b
    uint8 [E, N, K/2], sb the swizzled expert scales as uint8. For ``fp4_grouped_mm`` (a uint8 [T, K/2], sa its
    grouped swizzled scales) the tokens are first decoded to bf16, exact, by ``dequantize_grouped_rows`` (a second
    launch, as ``humming:grouped`` does; the global scales stay in alpha), with ``register_a`` straight into the
    decode's K order (no ``permute_a`` launch)."""
    e, n, k2 = b.shape
    t, k = a.shape[0], k2 * 2
    kb = k // 16
    if a.dtype == torch.uint8:
        lda = k_order_width(k) if cfg.register_a else k
        ops = workspace.scratch("grouped_tokens", (t, lda), torch.bfloat16, a.device)
        table = workspace.scratch("grouped_tokens_table", (offs.numel() + 1,), torch.int32, a.device)
        dequantize_grouped_rows(a, sa, offs, ops, table, k_order=cfg.register_a)
    else:
        ops, lda = permute_a(a, {}) if cfg.register_a else (a, k)
    grid = (runtime.cdiv(n, cfg.block_n), runtime.cdiv(t, cfg.block_m) + min(e, t))
    bf16 = ops.dtype == torch.bfloat16
    runtime.launch(grouped_w4a16_kernel, grid, ops, b, sb, alpha, out, offs, t, n, k2, kb, runtime.cdiv(kb, 4),
                   runtime.cdiv(n, 128) * 128, e, lda, ALPHA_E=alpha.numel() > 1,
                   EP=max(16, triton.next_power_of_2(e)), BM=cfg.block_m, BN=cfg.block_n, BKB=cfg.k_blocks,
                   DOT_F32=runtime.jit_interpreted(), REG_A=cfg.register_a, BF16=bf16,
                   num_warps=cfg.warps, num_stages=cfg.stages)
