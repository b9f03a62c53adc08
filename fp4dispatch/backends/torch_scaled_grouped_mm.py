"""``torch:scaled_grouped_mm``: PyTorch's NVFP4 grouped GEMM (``torch.nn.functional.scaled_grouped_mm``, FBGEMM's /
MSLK's ``f4f4bf16_grouped_mm``: SM100) for ``fp4_grouped_mm``.

As PyTorch's own tests call it (``test/test_scaled_matmul_cuda.py``, the 2d-3d NVFP4 case): ``mat_a`` the
``float4_e2m1fn_x2`` view of the packed [T, K/2] rows, ``mat_b`` the transposed view [E, K/2, N] of the [E, N, K/2]
experts, each side's scales the two-level NVFP4 recipe ``[BlockWise1x16, TensorWise]`` with ``SWIZZLE_32_4_4``
blocks: the activation scales in the grouped layout fp4dispatch takes itself (each expert's block from row
``sum_{j<e} round_up(rows_j, 128)``), the weight scales flattened per expert ([E, round_up(N,128) *
round_up(K/16,4)]), and fp32 [E] global scales whose product per expert is alpha[e] (alpha on the activation side,
ones on the weight side). ``offs`` is torch's own convention. Output bf16 only. No layout moves per call.
"""
from __future__ import annotations

import torch

from ..problem import GroupedOperands, Problem
from ._native import alignment_reason
from .base import Config
from .torch_scaled_mm import TorchScaledMmBackend

__all__ = ["TorchScaledGroupedMmBackend"]


class TorchScaledGroupedMmBackend(TorchScaledMmBackend):
    """``torch.nn.functional.scaled_grouped_mm`` with ``float4_e2m1fn_x2`` operands (SM100); the per-device ones of
    the weight side's global scales are kept as ``torch:scaled_mm`` keeps its own."""

    name = "torch:scaled_grouped_mm"
    ops = ("grouped",)

    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return "needs CUDA (torch's NVFP4 grouped GEMM has no CPU kernel)"
        if getattr(torch, "float4_e2m1fn_x2", None) is None or not hasattr(torch.nn.functional,
                                                                            "scaled_grouped_mm"):
            return (f"torch {torch.__version__} has no torch.nn.functional.scaled_grouped_mm with float4_e2m1fn_x2 "
                    "(a newer torch has it)")
        if cc // 10 != 10:
            return (f"torch's NVFP4 grouped GEMM (FBGEMM/MSLK f4f4bf16_grouped_mm) runs on SM100 only; this is "
                    f"SM{cc}")
        return None

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype != torch.bfloat16:
            return f"torch's NVFP4 grouped GEMM writes bfloat16 only; got out_dtype={problem.out_dtype}"
        return alignment_reason(problem, 16, 32, "torch's NVFP4 grouped GEMM (16-element aligned dims)")

    def configs(self, problem: Problem) -> list[Config]:
        return [{}]

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        F = torch.nn.functional
        st, sw = F.ScalingType, F.SwizzleType
        e = problem.experts
        fp4 = torch.float4_e2m1fn_x2
        key = (problem.device, e)
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = torch.ones(e, dtype=torch.float32, device=problem.device)
        alpha = ops.alpha if ops.alpha.numel() == e else ops.alpha.reshape(1).expand(e).contiguous()
        r = F.scaled_grouped_mm(ops.a.view(fp4), ops.b.view(fp4).transpose(-2, -1),
                                scale_a=[ops.a_scale, alpha], scale_recipe_a=[st.BlockWise1x16, st.TensorWise],
                                scale_b=[ops.b_scale.reshape(e, -1), ones],
                                scale_recipe_b=[st.BlockWise1x16, st.TensorWise],
                                swizzle_a=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
                                swizzle_b=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE], offs=ops.offs,
                                output_dtype=torch.bfloat16)
        ops.out.copy_(r)
