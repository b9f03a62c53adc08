"""``flashinfer:trtllm``: FlashInfer's TRT-LLM-gen FP4 GEMM, which needs the weight *shuffled*.

FlashInfer prepares a trtllm weight with ``nvfp4_quantize(w, gs, do_shuffle=True)``: the packed rows are permuted by
``shuffle_matrix_a(w, epilogue_tile_m=128)`` and the linear scales by the same row permutation before the 128x4
interleave, reshaped to [N, K/16] (so N % 128 == 0 and K % 64 == 0, no padding). No other backend reads that form.

Choice (documented in docs/backends.md): fp4_mm keeps the canonical weight and prepares the shuffled copy itself,
**once per weight**, in ``_native.PreparedWeightCache`` (bounded; an in-place change or a freed weight is never
served stale: see there).
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..format import BLOCK, swizzle_scales, unswizzle_scales
from ..problem import Operands, Problem
from ._native import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, PreparedWeightCache, alignment_reason, \
    clear_prepared_weights
from .flashinfer import FlashInferBackend

__all__ = ["FlashInferTrtllmBackend", "PreparedWeightCache", "prepare_trtllm_weight", "clear_prepared_weights"]

EPILOGUE_TILE_M = 128  # what FlashInfer's nvfp4_quantize(do_shuffle=True) uses


def prepare_trtllm_weight(b: torch.Tensor, b_scale: torch.Tensor, n: int, k: int,
                          row_indices: Callable[[torch.Tensor, int], torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shuffled weight ``(b_shuffled uint8 [N, K/2], b_sf_shuffled uint8 [N, K/16])`` that trtllm reads.

    ``row_indices`` is FlashInfer's ``get_shuffle_matrix_a_row_indices`` (``new_row r = old_row idx[r]``). The scale
    interleave is fp4dispatch's own 128x4 swizzle, the same layout as FlashInfer's ``block_scale_interleave`` but
    plain torch (no JIT module needed).
    """
    b8 = b.view(torch.uint8)
    idx = row_indices(b8, EPILOGUE_TILE_M).to(b.device)
    b_sh = b8[idx].contiguous()
    lin = unswizzle_scales(b_scale.view(torch.uint8), n, k // BLOCK)
    sf_sh = swizzle_scales(lin[idx].contiguous()).reshape(n, k // BLOCK)
    return b_sh, sf_sh


class FlashInferTrtllmBackend(FlashInferBackend):
    """``mm_fp4(backend="trtllm")`` with the shuffled weight prepared once per weight (bf16 out, SM100/103)."""

    _transient = ("_lib", "_checked", "prepared")

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__("trtllm")
        self._limits = (max_entries, max_bytes)
        self.prepared = PreparedWeightCache(self.name, max_entries, max_bytes)

    def _reset_transient(self) -> None:
        super()._reset_transient()
        self.prepared = PreparedWeightCache(self.name, *self._limits)

    def _backend_rules(self, problem: Problem, cc: int) -> str | None:
        if problem.out_dtype != torch.bfloat16:
            return f"trtllm writes bfloat16 only; got out_dtype={problem.out_dtype}"
        return alignment_reason(problem, 128, 64, "trtllm's shuffled weight (rows permuted in 128-row tiles)")

    def operands(self, problem: Problem, ops: Operands) -> tuple:
        def prepare() -> tuple:
            row_indices = importlib.import_module("flashinfer.utils").get_shuffle_matrix_a_row_indices
            return prepare_trtllm_weight(ops.b, ops.b_scale, problem.n, problem.k, row_indices)

        b_sh, sf_sh = self.prepared.get(ops.b, ops.b_scale, prepare)
        return ops.a, b_sh.T, ops.a_scale.view(torch.uint8), sf_sh.T, ops.alpha
