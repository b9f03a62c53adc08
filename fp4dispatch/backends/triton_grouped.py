"""``triton:grouped``: ``fp4_grouped_mm`` (the MoE expert GEMM) in one Triton launch for GPUs without FP4 tensor
cores (and ``w4a16_grouped_mm``, bf16/fp16 activations as they are: ``kernels/gemm/mma_w4a16_grouped.py``): every
CTA finds its expert's M tile from ``offs`` on the GPU and decodes both operands in registers (exact);
a CUDA-core GEMV per expert for decode batches (``kernels/gemv/cuda_core_grouped.py``), 16-bit tensor-core tiles with
fp32 sums for larger ones (``kernels/gemm/mma_grouped.py``). No host sync, so one CUDA graph
serves every routing; an expert without rows costs nothing. Runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from ..kernels import device_problem
from ..kernels.grouped_mm import grouped_mm
from ..problem import GroupedOperands, Problem
from .base import BaseBackend, Config

__all__ = ["TritonGroupedBackend"]


class TritonGroupedBackend(BaseBackend):
    """The grouped kernel; the tuner picks among :func:`~fp4dispatch.kernels.heuristics.grouped_configs_for`'s
    typed configs."""

    name = "triton:grouped"
    risky = False
    compiles_ahead = True  # its kernels are Triton's: the tuner compiles its configs in parallel (key_compiles.py)
    ops = ("grouped", "w4a16_grouped")

    def unavailable(self, device: torch.device) -> str | None:
        return device_problem(device)

    def configs(self, problem: Problem) -> list[Config]:
        from ..kernels.heuristics import grouped_configs_for, w4a16_grouped_configs_for

        if problem.op == "w4a16_grouped":
            return w4a16_grouped_configs_for(problem.m, problem.experts, problem.n, problem.k, problem.device)
        return grouped_configs_for(problem.m, problem.experts, problem.n, problem.k, problem.device)

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        grouped_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, ops.offs, config)
