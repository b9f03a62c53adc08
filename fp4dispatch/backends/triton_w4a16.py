"""``triton:w4a16``: ``w4a16_mm`` in one Triton kernel, for GPUs without FP4 tensor cores: the bf16/fp16
activations are read as they are and the NVFP4 weight is decoded in registers (from SM89 straight into the
register operand of a 16-bit tensor-core tile; a CUDA-core GEMV for M <= 8; ``tl.dot`` tiles); fp32 sums, alpha in
fp32 at the end. Runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from ..kernels import device_problem
from ..kernels.w4a16_mm import w4a16_mm
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["TritonW4A16Backend"]


class TritonW4A16Backend(BaseBackend):
    """The W4A16 kernels of ``kernels/w4a16_mm.py``; the tuner picks among
    :func:`~fp4dispatch.kernels.heuristics.w4a16_configs_for`'s typed configs."""

    name = "triton:w4a16"
    risky = False
    compiles_ahead = True  # its kernels are Triton's: the tuner compiles its configs in parallel (key_compiles.py)
    ops = ("w4a16",)

    def unavailable(self, device: torch.device) -> str | None:
        return device_problem(device)

    def configs(self, problem: Problem) -> list[Config]:
        from ..kernels.heuristics import w4a16_configs_for

        return w4a16_configs_for(problem.m, problem.n, problem.k, problem.device)

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        w4a16_mm(ops.a, ops.b, ops.b_scale, ops.alpha, ops.out, config)
