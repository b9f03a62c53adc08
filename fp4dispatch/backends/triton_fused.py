"""``triton:fused``: NVFP4 x NVFP4 in one Triton kernel for GPUs without FP4 tensor cores (Hopper, Ada, Ampere).

Both operands are decoded in registers (bit placement, no lookup table), multiplied on tensor cores (``wmma``: the
weight as the wgmma register operand, SM89+, the H200's pick from M = 3; ``mma``: bf16 tiles, any M, the fallback
before SM89; ``wgws``: ``wmma``'s tiles as a warp-specialized Gluon kernel fed by TMA, SM90 with Triton 3.6, the
M >= 1024 pick; plain, persistent or with the operands' roles swapped; ``wgds``: the weight decoded by warps of their
own into shared memory for a warpgroup that only issues wgmma, SM90 with Triton 3.6, offered at 64 < M <= 128) or on
CUDA cores (``gemv2``: int64 words = whole 16-blocks, the M <= 2 pick; ``gvws``: a Gluon GEMV fed by TMA whose
16-block sums are exact int8 dot products of the codes looked up as 2 * e2m1, SM90 with Triton 3.6, the H200's M <= 2
pick on the large shapes; ``gemv``: bytes), accumulated in fp32; alpha is applied in fp32 at the end (kernels and
configs: ``kernels/fused.py``).
Exact up to fp32 summation order and the output cast. Runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from ..kernels import device_problem
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["TritonFusedBackend"]


class TritonFusedBackend(BaseBackend):
    """Fused decode + GEMM/GEMV Triton kernels; the tuner picks among :func:`~fp4dispatch.kernels.fused.configs_for`."""

    name = "triton:fused"
    risky = False

    def unavailable(self, device: torch.device) -> str | None:
        return device_problem(device)

    def configs(self, problem: Problem) -> list[Config]:
        from ..kernels.fused import configs_for

        return configs_for(problem.m, problem.n, problem.k, problem.device)

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        from ..kernels.fused import fused_mm

        fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, config)
