"""``sgl_kernel:cutlass_group``: sgl-kernel's CUTLASS NVFP4 grouped GEMM ``cutlass_fp4_group_mm`` (SM100/SM120, the
kernel behind SGLang's and vLLM's ``cutlass_moe_fp4``) for ``fp4_grouped_mm``.

Its contract is fp4dispatch's grouped layout (docs/contract.md), as SGLang's test of the kernel builds it
(``test_nvfp4_blockwise_moe_grouped_mm``): ``a`` uint8 [T, K/2] grouped by expert, ``b`` uint8 [E, N, K/2],
``a_blockscale`` float8_e4m3fn with each expert's 128x4-swizzled block at ``blockscale_offsets[e] = sum_{j<e}
round_up(rows_j, 128)``, ``b_blockscale`` float8_e4m3fn [E, round_up(N, 128), round_up(K/16, 4)], ``alphas`` float32
[E], and ``params``: ``ab_strides`` int64 [E] (K), ``c_strides`` int64 [E] (N), ``problem_sizes`` int32 [E, 3]
(rows_e, N, K), ``expert_offsets`` int32 [E] (each expert's first row). Nothing moves per call: the five small tables
are made from ``offs`` on the device (no host read, CUDA-graph safe), and the result, which the function allocates, is
copied into ``out``. sgl-kernel 0.3.21's function takes ``device`` before ``params``; SGLang's JIT kernel of the same
name does not (it also takes pointer scratch tensors, passed here too): both are called as they are declared.
"""
from __future__ import annotations

import inspect

import torch

from ..format_grouped import rows_per_expert, scale_starts
from ..problem import GroupedOperands, Problem
from ._native import alignment_reason
from .base import Config
from .sgl_kernel import SglKernelBackend

__all__ = ["SglKernelGroupedBackend", "group_params"]

_SCRATCH = ("a_ptrs", "b_ptrs", "out_ptrs", "a_scales_ptrs", "b_scales_ptrs", "alpha_ptrs")


def group_params(offs: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """The ``params`` of ``cutlass_fp4_group_mm`` for the routing ``offs`` (int32 [E] end rows) of [N, K] experts."""
    e, dev = offs.numel(), offs.device
    rows = rows_per_expert(offs).to(torch.int32)
    params = {"ab_strides": torch.full((e,), k, dtype=torch.int64, device=dev),
              "c_strides": torch.full((e,), n, dtype=torch.int64, device=dev),
              "problem_sizes": torch.stack((rows, torch.full_like(rows, n), torch.full_like(rows, k)), dim=1),
              "expert_offsets": offs.to(torch.int32) - rows,
              "blockscale_offsets": scale_starts(offs)[:-1].to(torch.int32)}
    params.update({name: torch.empty((e,), dtype=torch.int64, device=dev) for name in _SCRATCH})
    params.update({name: torch.empty((e, 5), dtype=torch.int64, device=dev) for name in ("layout_sfa", "layout_sfb")})
    return params


class SglKernelGroupedBackend(SglKernelBackend):
    """sgl-kernel's CUTLASS NVFP4 grouped GEMM on fp4dispatch's grouped operands as they are."""

    name = "sgl_kernel:cutlass_group"
    ops = ("grouped",)
    function = "cutlass_fp4_group_mm"

    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in (torch.bfloat16, torch.float16):
            return f"sgl_kernel's cutlass_fp4_group_mm writes bfloat16/float16 only; got out_dtype={problem.out_dtype}"
        return alignment_reason(problem, 32, 32, "sgl_kernel cutlass_fp4_group_mm")

    def run(self, problem: Problem, ops: GroupedOperands, config: Config) -> None:
        fn = getattr(self._lib or self._load(), self.function)
        e = problem.experts
        params = group_params(ops.offs, problem.n, problem.k)
        alphas = ops.alpha.expand(e).contiguous()
        args = (ops.a, ops.b, ops.a_scale, ops.b_scale.reshape(e, -1, ops.a_scale.shape[1]), alphas,
                problem.out_dtype)
        if _takes_device(fn):
            ops.out.copy_(fn(*args, ops.a.device, params))
        else:
            ops.out.copy_(fn(*args, params))


def _takes_device(fn) -> bool:
    """Whether ``fn`` is sgl-kernel 0.3.21's form, with ``device`` before ``params``."""
    try:
        return "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the older, documented form
        return True
