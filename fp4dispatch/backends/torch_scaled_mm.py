"""``torch:scaled_mm``: PyTorch's cuBLASLt block-scaled FP4 GEMM (SM100/SM120, CUDA >= 12.8, torch >= 2.8).

As PyTorch's own tests call it (``test/test_scaled_matmul_cuda.py``): ``torch._scaled_mm(A, B.t(), A_sf, B_sf,
out_dtype=...)`` with A, B ``float4_e2m1fn_x2`` views of the packed [M, K/2] and [N, K/2] bytes (``B.t()`` the
column-major [K/2, N] view), and the 128x4-swizzled float8_e4m3fn scales flattened (``to_blocked``). cuBLASLt takes
no global scale on this path (``scale_result`` is unsupported), so alpha is applied afterwards, in fp32, on a bf16
result (bf16 keeps the range of the unscaled products, which overflow fp16). Where ``torch.nn.functional.scaled_mm``
exists, a second config passes alpha as the TensorWise half of the two-level NVFP4 recipe
(``[BlockWise1x16, TensorWise]``), fused in the kernel; tuning keeps whichever is correct and faster.

On SM90 cuBLASLt refuses (``CUBLAS_STATUS_NOT_SUPPORTED``, measured on the H200): that is an ``unavailable`` reason.
N and K are not padded (unsupported instead).
"""
from __future__ import annotations

import torch

from ..problem import Operands, Problem
from ._native import NativeBackend, alignment_reason
from .base import Config

__all__ = ["TorchScaledMmBackend"]

_FP4_FAMILIES = (10, 11, 12)  # SM100/103, SM110, SM120/121: GPUs with block-scaled FP4 tensor cores


def _cuda_at_least(v: str, major: int, minor: int) -> bool:
    try:
        parts = [int(x) for x in v.split(".")[:2]]
    except ValueError:
        return True  # unparsable: let the probe decide
    return tuple(parts + [0] * (2 - len(parts))) >= (major, minor)


class TorchScaledMmBackend(NativeBackend):
    """``torch._scaled_mm`` with ``float4_e2m1fn_x2`` operands and e4m3 block scales (cuBLASLt)."""

    name = "torch:scaled_mm"
    _transient = ("_lib", "_ones")

    def __init__(self) -> None:
        super().__init__()
        self._ones: dict[torch.device, torch.Tensor] = {}

    def _reset_transient(self) -> None:
        self._lib = None
        self._ones = {}

    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return "needs CUDA (torch._scaled_mm has no CPU kernel for FP4)"
        if getattr(torch, "float4_e2m1fn_x2", None) is None or not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no float4_e2m1fn_x2 _scaled_mm (needs torch >= 2.8)"
        if cc // 10 not in _FP4_FAMILIES:
            return f"torch._scaled_mm fp4 needs SM100/SM120 (cuBLASLt block-scaled FP4); this is SM{cc}"
        cuda = torch.version.cuda
        if cuda and not _cuda_at_least(cuda, 12, 8):
            return f"torch._scaled_mm fp4 needs a CUDA >= 12.8 build of torch (cuBLASLt block-scaled FP4); got {cuda}"
        return None

    def unsupported(self, problem: Problem) -> str | None:
        return alignment_reason(problem, 32, 32, "cuBLASLt block-scaled FP4 (16-byte aligned packed rows)")

    def configs(self, problem: Problem) -> list[Config]:
        cfgs: list[Config] = [{"api": "_scaled_mm"}]
        if hasattr(torch.nn.functional, "scaled_mm"):
            cfgs.append({"api": "scaled_mm_v2"})
        return cfgs

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        fp4 = torch.float4_e2m1fn_x2
        a = ops.a.view(fp4)
        b = ops.b.view(fp4).t()  # [K/2, N] column-major
        sa = ops.a_scale.reshape(-1)  # flattened 128x4 blocks, as to_blocked returns them
        sb = ops.b_scale.reshape(-1)
        if config.get("api") == "scaled_mm_v2":
            self._run_v2(problem, ops, a, b, sa, sb)
            return
        acc = torch.float32 if problem.out_dtype == torch.float32 else torch.bfloat16
        r = torch._scaled_mm(a, b, sa, sb, out_dtype=acc)
        torch.mul(r, ops.alpha, out=ops.out)

    def _run_v2(self, problem: Problem, ops: Operands, a, b, sa, sb) -> None:
        F = torch.nn.functional
        st, sw = F.ScalingType, F.SwizzleType
        one = self._ones.get(problem.device)
        if one is None:
            one = self._ones[problem.device] = torch.ones((), dtype=torch.float32, device=problem.device)
        r = F.scaled_mm(a, b,
                        scale_a=[sa, ops.alpha.reshape(())], scale_recipe_a=[st.BlockWise1x16, st.TensorWise],
                        scale_b=[sb, one], scale_recipe_b=[st.BlockWise1x16, st.TensorWise],
                        swizzle_a=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE], swizzle_b=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
                        output_dtype=problem.out_dtype)
        ops.out.copy_(r)
