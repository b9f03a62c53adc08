"""``flashinfer:cudnn_grouped``: cuDNN's block-scaled MoE grouped GEMM through FlashInfer,
``flashinfer.grouped_mm.grouped_mm_fp4(..., backend="cudnn")`` (SM100-SM121, cuDNN >= 9.21; SM12x >= 9.22), for
``fp4_grouped_mm``.

Its contract (FlashInfer 0.7.4 ``grouped_mm/core.py`` ``_check_grouped_mm_fp4`` and ``grouped_mm/cudnn/core.py``; its
tests/grouped_mm/test_grouped_mm_fp4.py calls it so): ``a`` uint8 [cum_m, K/2], ``b`` uint8 [E, N, K/2], ``a_descale``
float8_e4m3fn [cum_m, K/16], one 128x4-swizzled matrix over all of a's rows (the tests quantize the whole of ``a`` at
once), ``b_descale`` float8_e4m3fn [E, N, K/16] swizzled per expert, ``m_indptr`` int32 [E+1] (the last expert runs to
cum_m), ``alpha`` None or a float32 (1,) for every expert, out bf16/fp16/fp32.

Every segment in those tests is a multiple of 128 rows, and only then is one swizzled matrix over all rows the same as
fp4dispatch's per-expert blocks. So each call places expert e's rows at ``sum_{j<e} round_up(rows_j, 128)`` of a
zero-padded copy of ``a`` (``grouped_scale_rows(T, E)`` rows: any routing fits), where fp4dispatch's activation scales
already are, and gathers the output rows back; the padding rows cost MMA work, not correctness. A per-expert alpha,
which the call does not take, is applied in float32 to a float32 result, then rounded once. Fixed-size torch ops, no
host read: CUDA-graph safe.
"""
from __future__ import annotations

import importlib

import torch

from ..errors import describe_exception
from ..format_grouped import expert_of_rows, grouped_scale_rows, padded_rows, scale_starts
from ..problem import GroupedOperands, Problem
from ._native import alignment_reason
from .base import Config
from .flashinfer_function import FlashInferFunctionBackend

__all__ = ["FlashInferCudnnGroupedBackend"]

_OUT = (torch.bfloat16, torch.float16, torch.float32)


class FlashInferCudnnGroupedBackend(FlashInferFunctionBackend):
    """``flashinfer.grouped_mm.grouped_mm_fp4(backend="cudnn")`` on 128-row-aligned expert segments."""

    name = "flashinfer:cudnn_grouped"
    ops = ("grouped",)
    function, kernel = "grouped_mm.grouped_mm_fp4", "cuDNN's grouped GEMM"

    def _refused(self, cc: int) -> str:
        return f"FlashInfer's grouped_mm_fp4 (cuDNN) does not support SM{cc}"

    def _gate(self, fi, cc: int) -> str | None:
        """FlashInfer's own cuDNN version check for the block-scaled MoE GEMM, where this FlashInfer has it."""
        try:
            core = importlib.import_module(f"{fi.__name__}.grouped_mm.core")
            version, check = core._cudnn_moe_block_scale_min_version, core._check_cudnn_version
        except Exception:  # noqa: BLE001 - a layout without the helpers: the probe decides
            return None
        try:
            check(version(cc), "grouped_mm_fp4")
        except Exception as e:  # noqa: BLE001 - FlashInfer raises RuntimeError with its own reason
            return f"cudnn: {describe_exception(e)}"
        return None

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in _OUT:
            return f"cuDNN's grouped GEMM writes bfloat16/float16/float32 only; got out_dtype={problem.out_dtype}"
        return alignment_reason(problem, 128, 128, "cuDNN's grouped GEMM (whole 128-row scale tiles)")

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        fn = self._call()
        t, e, kb = problem.m, problem.experts, problem.k // 16
        rows = grouped_scale_rows(t, e)
        row_map = padded_rows(ops.offs, t)
        a = ops.a.new_zeros((rows, problem.k // 2)).index_copy_(0, row_map, ops.a)
        sa = ops.a_scale.new_zeros((rows, kb))
        have = min(rows, ops.a_scale.shape[0])
        sa[:have] = ops.a_scale[:have, :kb]
        indptr = scale_starts(ops.offs).to(torch.int32)
        sb = ops.b_scale.reshape(e, -1, kb)
        if ops.alpha.numel() == 1:  # one alpha: cuDNN applies it in its epilogue
            out = fn(a, ops.b, sa, sb, indptr, alpha=ops.alpha.reshape(1), out_dtype=problem.out_dtype,
                     block_size=16, backend="cudnn")
            torch.index_select(out, 0, row_map, out=ops.out)
            return
        out = fn(a, ops.b, sa, sb, indptr, alpha=None, out_dtype=torch.float32, block_size=16, backend="cudnn")
        alpha = ops.alpha[expert_of_rows(ops.offs, t).clamp(max=e - 1)].unsqueeze(1)
        ops.out.copy_(out.index_select(0, row_map) * alpha)
