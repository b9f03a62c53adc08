"""``flashinfer:group_gemm``: FlashInfer's NVFP4 grouped GEMM, ``flashinfer.gemm.group_gemm_nvfp4_nt_groupwise``
(SM120/SM121, CUTLASS block-scaled FP4 MMA), for ``fp4_grouped_mm``.

Its contract (FlashInfer 0.7.4 ``gemm_base.py``, ``_check_group_gemm_nvfp4_nt_groupwise_problem_size`` and
``group_gemm_nvfp4_groupwise_sm120.cuh``; its tests/gemm/test_group_gemm_fp4.py calls it so):

- ``a`` uint8 [cum_m, K/2], the rows of group i at ``m_indptr[i]:m_indptr[i+1]``; ``m_indptr`` int32 [E+1], every
  value a multiple of 4 (each group's rows padded to a multiple of 4);
- ``a_scale`` uint8 [rows, K/16]: group i's rows' scales as one 128x4-swizzled matrix at row
  ``(m_indptr[i] + 127 i) // 128 * 128`` (TensorRT-LLM's rule: a block never overlaps the next);
- ``b`` uint8 [E, N, K/2]; ``b_scale`` uint8 [E, round_up(N, 128), K/16], each expert's own swizzled matrix;
- ``alpha`` float32 [E]; ``out`` [cum_m, N] bfloat16 or float16; N % 8 == 0 and K % 128 == 0;
- tile_m 128, tile_n 32/64/128, tile_k 128/256, ``swap_ab`` (the configs tuned here).

fp4dispatch's rows are not padded per expert and its activation scale blocks follow each other (docs/contract.md),
so each call moves them, with fixed-size torch ops that read nothing on the host (CUDA-graph safe): each expert's
rows to the start of its padded segment, each scale block to FlashInfer's row, and the output rows back.
"""
from __future__ import annotations

import torch

from ..format_grouped import expert_of_rows, rows_per_expert, scale_starts
from ..problem import GroupedOperands, Problem
from .base import Config
from .flashinfer_function import FlashInferFunctionBackend

__all__ = ["FlashInferGroupGemmBackend", "flashinfer_layout", "flashinfer_scale_rows"]

_HALF = (torch.bfloat16, torch.float16)


def flashinfer_layout(offs: torch.Tensor, t: int, e: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(``m_indptr`` int32 [E+1] with each expert's rows padded to a multiple of 4, the padded row of each of the T
    rows, the rows a padded ``a`` needs for any routing: T + 3E) of the routing ``offs``. Fixed shapes, no host
    read."""
    rows = rows_per_expert(offs)
    indptr = torch.nn.functional.pad(((rows + 3) // 4 * 4).cumsum(0), (1, 0))
    expert = expert_of_rows(offs, t).clamp(max=e - 1)
    first = offs.long()[expert] - rows[expert]
    return indptr.to(torch.int32), torch.arange(t, device=offs.device) - first + indptr[expert], t + 3 * e


def flashinfer_scale_rows(offs: torch.Tensor, indptr: torch.Tensor, rows_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source row in fp4dispatch's grouped scale layout of each of ``rows_out`` FlashInfer scale rows, whether that
    row holds one): expert e's block of ``round_up(rows_e, 128)`` rows moves from ``scale_starts(offs)[e]`` to
    ``(indptr[e] + 127 e) // 128 * 128``."""
    src_start = scale_starts(offs)
    block = src_start[1:] - src_start[:-1]
    e = torch.arange(offs.numel(), device=offs.device)
    dst_start = (indptr[:-1].long() + 127 * e) // 128 * 128
    i = torch.arange(rows_out, device=offs.device)
    owner = (torch.searchsorted(dst_start, i, right=True) - 1).clamp(min=0)
    j = i - dst_start[owner]
    valid = (j >= 0) & (j < block[owner])
    return torch.where(valid, src_start[owner] + j, 0), valid


class FlashInferGroupGemmBackend(FlashInferFunctionBackend):
    """``flashinfer.gemm.group_gemm_nvfp4_nt_groupwise`` on padded copies of the rows and moved scale blocks."""

    name = "flashinfer:group_gemm"
    ops = ("grouped",)
    function, kernel = "gemm.group_gemm_nvfp4_nt_groupwise", "FlashInfer's NVFP4 grouped GEMM"

    def _refused(self, cc: int) -> str:
        return f"{self.kernel} runs on SM120/SM121 only; this is SM{cc}"

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in _HALF:
            return f"FlashInfer's NVFP4 grouped GEMM writes bfloat16/float16 only; got out_dtype={problem.out_dtype}"
        if problem.n % 8 or problem.k % 128:
            return (f"FlashInfer's NVFP4 grouped GEMM needs N % 8 == 0 and K % 128 == 0; got N={problem.n}, "
                    f"K={problem.k}")
        return None

    def configs(self, problem: Problem) -> list[Config]:
        tiles_n = [tn for tn in (128, 64, 32) if problem.n % tn == 0] or [32]
        tiles_k = [tk for tk in (128, 256) if problem.k % tk == 0]
        return [{"tile_n": tn, "tile_k": tk, "swap_ab": s} for s in (True, False) for tn in tiles_n[:2]
                for tk in tiles_k]

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        fn = self._call()
        t, e, k2 = problem.m, problem.experts, problem.k // 2
        indptr, row_map, rows = flashinfer_layout(ops.offs, t, e)
        a = ops.a.new_zeros((rows, k2)).index_copy_(0, row_map, ops.a)
        sa_rows = (2 * t + 130 * e + 255) // 128 * 128  # >= the last block's end for any routing of T rows
        src, valid = flashinfer_scale_rows(ops.offs, indptr, sa_rows)
        sa_in = ops.a_scale.view(torch.uint8)
        sa = torch.where(valid.unsqueeze(1), sa_in[src.clamp(max=sa_in.shape[0] - 1)], 0)
        alpha = self._alpha(ops, e)
        out = torch.empty((rows, problem.n), dtype=problem.out_dtype, device=ops.out.device)
        fn(a, ops.b, sa, ops.b_scale.view(torch.uint8).reshape(e, -1, problem.k // 16), indptr, alpha, tile_m=128,
           tile_n=config["tile_n"], tile_k=config["tile_k"], swap_ab=config["swap_ab"], out=out,
           out_dtype=problem.out_dtype)
        torch.index_select(out, 0, row_map, out=ops.out)

    @staticmethod
    def _alpha(ops: GroupedOperands, e: int) -> torch.Tensor:
        """alpha as FlashInfer reads it: float32 [E] (fp4dispatch's may be one value for every expert)."""
        return ops.alpha.float().expand(e).contiguous()
