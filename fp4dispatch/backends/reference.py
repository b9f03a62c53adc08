"""``reference``: exact emulation — dequantize, then matmul with fp32 accumulation, alpha applied last in fp32.

Dequantized NVFP4 values (e2m1 x e4m3) are exact in fp32 and bf16, and products of two are exact in fp32, so the
only error is the summation order and the final cast. It is the oracle every other backend is checked against,
the CPU path, and the last-resort fallback.
"""
from __future__ import annotations

import torch

from ..format import dequantize_nvfp4
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["ReferenceBackend", "reference_mm"]


def reference_mm(problem: Problem, ops: Operands) -> torch.Tensor:
    """The exact result as float32 [M, N] (alpha applied); for ``w4a16`` ``a`` is used as it is."""
    w4a16 = problem.op == "w4a16"
    if ops.a.is_cuda:
        # 16-bit operands are exact (every e2m1 x e4m3 value fits bf16 and fp16; a w4a16 ``a`` is 16-bit already);
        # a 16-bit GEMM with an fp32 output accumulates and returns in fp32.
        dt = ops.a.dtype if w4a16 else torch.bfloat16
        a = ops.a if w4a16 else dequantize_nvfp4(ops.a, ops.a_scale, dtype=dt)
        b = dequantize_nvfp4(ops.b, ops.b_scale, dtype=dt)
        try:
            acc = torch.mm(a, b.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            acc = torch.mm(a.double(), b.double().t()).float()
    else:
        a = ops.a.float() if w4a16 else dequantize_nvfp4(ops.a, ops.a_scale)
        b = dequantize_nvfp4(ops.b, ops.b_scale)
        acc = torch.mm(a, b.t())
    return acc * ops.alpha.float()


class ReferenceBackend(BaseBackend):
    """Exact dequantize+matmul (``torch`` only): always available, slow; the oracle and the fallback."""

    name = "reference"
    ops = ("fp4_mm", "w4a16")

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        ops.out.copy_(reference_mm(problem, ops))
