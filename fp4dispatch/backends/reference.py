"""``reference``: exact emulation — dequantize, then matmul with fp32 accumulation, alpha applied last in fp32.

Dequantized NVFP4 values (e2m1 x e4m3) are exact in fp32 and bf16, and products of two are exact in fp32, so the
only error is the summation order and the final cast. It is the oracle every other backend is checked against,
the CPU path, and the last-resort fallback.
"""
from __future__ import annotations

import torch

from ..format import BLOCK, dequantize_nvfp4
from ..format_grouped import dequantize_grouped, unswizzle_expert_scales
from ..problem import GroupedOperands, Operands, Problem
from .base import BaseBackend, Config

__all__ = ["ReferenceBackend", "reference_mm"]


@torch.no_grad()  # the ops are not differentiable: an input that requires grad must not give out a grad_fn
def reference_mm(problem: Problem, ops: Operands) -> torch.Tensor:
    """The exact result as float32 [M, N] (alpha applied); for ``w4a16`` ``a`` is used as it is; for ``grouped``
    each expert's rows against its own weight (``w4a16_grouped``: with ``a`` as it is)."""
    if problem.experts:
        return _grouped(problem, ops)
    w4a16 = problem.op == "w4a16"
    # 16-bit operands on CUDA are exact (every e2m1 x e4m3 value fits bf16 and fp16; a w4a16 ``a`` is 16-bit)
    dt = (ops.a.dtype if w4a16 else torch.bfloat16) if ops.a.is_cuda else torch.float32
    a = ops.a if w4a16 else dequantize_nvfp4(ops.a, ops.a_scale, dtype=dt)
    return _mm_f32(a, dequantize_nvfp4(ops.b, ops.b_scale, dtype=dt)) * ops.alpha.float()


def _grouped(problem: Problem, ops: GroupedOperands) -> torch.Tensor:
    """Per expert, on its rows (``offs`` is read on the host: the reference is not a CUDA-graph path)."""
    n, k = problem.n, problem.k
    if problem.op == "w4a16_grouped":  # a as given; the weight decoded to its dtype (exact, as in reference_mm)
        dt = ops.a.dtype if ops.a.is_cuda else torch.float32
        a = ops.a
    else:
        dt = torch.bfloat16 if ops.a.is_cuda else torch.float32  # exact either way (see reference_mm)
        a = dequantize_grouped(ops.a, ops.a_scale, ops.offs, dt)
    b_scales = unswizzle_expert_scales(ops.b_scale, n, k // BLOCK)
    alpha = ops.alpha.float().reshape(-1)
    out = torch.zeros((problem.m, n), dtype=torch.float32, device=ops.a.device)
    start = 0
    for e, end in enumerate(ops.offs.tolist()):
        if end > start:
            b = dequantize_nvfp4(ops.b[e], b_scales[e], scale_layout="linear", dtype=dt)
            out[start:end] = _mm_f32(a[start:end], b) * alpha[e if alpha.numel() > 1 else 0]
        start = end
    return out


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of exact operands with fp32 sums: on CUDA 16-bit operands into an fp32 output (a 16-bit GEMM
    accumulates and returns in fp32; float64 where this torch lacks ``out_dtype``), on the CPU fp32."""
    if a.is_cuda:
        try:
            return torch.mm(a, b.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            return torch.mm(a.double(), b.double().t()).float()
    return torch.mm(a.float(), b.float().t())


class ReferenceBackend(BaseBackend):
    """Exact dequantize+matmul (``torch`` only): always available, slow; the oracle and the fallback."""

    name = "reference"
    ops = ("fp4_mm", "w4a16", "grouped", "w4a16_grouped")

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        ops.out.copy_(reference_mm(problem, ops))
