"""``reference``: exact emulation — dequantize, then matmul with fp32 accumulation, alpha applied last in fp32.

Dequantized NVFP4 values (e2m1 x e4m3) are exact in fp32 and bf16, and products of two are exact in fp32, so the
only error is the summation order and the final cast. It is the oracle every other backend is checked against,
the CPU path, and the last-resort fallback.
"""
from __future__ import annotations

import torch

from ..format import BLOCK, _decode, unswizzle_scales
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["ReferenceBackend", "reference_mm"]


def _dequant(packed: torch.Tensor, scale_swizzled: torch.Tensor, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    s = unswizzle_scales(scale_swizzled, rows, k // BLOCK).to(dtype)
    v = _decode(packed, dtype)
    return (v.view(rows, k // BLOCK, BLOCK) * s.unsqueeze(-1)).view(rows, k)


def reference_mm(problem: Problem, ops: Operands) -> torch.Tensor:
    """The exact result as float32 [M, N] (alpha applied)."""
    m, n, k = problem.m, problem.n, problem.k
    if ops.a.is_cuda:
        # bf16 operands are exact; a bf16 GEMM with an fp32 output accumulates and returns in fp32.
        a = _dequant(ops.a, ops.a_scale, m, k, torch.bfloat16)
        b = _dequant(ops.b, ops.b_scale, n, k, torch.bfloat16)
        try:
            acc = torch.mm(a, b.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            acc = torch.mm(a.double(), b.double().t()).float()
    else:
        a = _dequant(ops.a, ops.a_scale, m, k, torch.float32)
        b = _dequant(ops.b, ops.b_scale, n, k, torch.float32)
        acc = torch.mm(a, b.t())
    return acc * ops.alpha.float()


class ReferenceBackend(BaseBackend):
    """Exact dequantize+matmul (``torch`` only): always available, slow; the oracle and the fallback."""

    name = "reference"

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        ops.out.copy_(reference_mm(problem, ops))
