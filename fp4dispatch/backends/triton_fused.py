"""``triton:fused``: NVFP4 x NVFP4 in one Triton kernel for GPUs without FP4 tensor cores (Hopper, Ada, Ampere).

Both operands are decoded in registers (bit placement or the e4m3x2 conversion, no lookup table) and multiplied on
tensor cores or CUDA cores, accumulated in fp32; alpha is applied in fp32 at the end. Seven kernel families, one
config class each (``kernels/config.py``); ``kernels/heuristics.py`` offers a few per problem and the tuner picks
one; docs/kernels.md says which wins where and why. Exact up to fp32 summation order and the output cast. Runs on CPU
tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from ..kernels import device_problem
from ..kernels.fp4_mm import fp4_mm
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["TritonFusedBackend"]


class TritonFusedBackend(BaseBackend):
    """Fused decode + GEMM/GEMV Triton kernels; the tuner picks among
    :func:`~fp4dispatch.kernels.heuristics.configs_for`'s typed configs, which :meth:`run` takes as they are."""

    name = "triton:fused"
    risky = False
    compiles_ahead = True  # its kernels are Triton's: the tuner compiles its configs in parallel (key_compiles.py)

    def unavailable(self, device: torch.device) -> str | None:
        return device_problem(device)

    def configs(self, problem: Problem) -> list[Config]:
        from ..kernels.heuristics import configs_for

        return configs_for(problem.m, problem.n, problem.k, problem.device)

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, config)
