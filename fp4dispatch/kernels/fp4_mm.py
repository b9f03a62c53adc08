"""``fp4_mm``: ``out = alpha * dequant(a) @ dequant(b).T`` with the kernel family a config names.

A table maps each config class to its family's launcher (``run`` in the family's module). The modules import Triton
(the Gluon ones, Gluon) when loaded, so each is imported the first time a config of its family runs.
"""
from __future__ import annotations

import torch

from . import plan
from .config import (BytewiseGemvConfig, CudaCoreGemvConfig, KernelConfig, MmaBf16Config, TmaGemvConfig,
                     WgmmaDecodeWarpsConfig, WgmmaRegisterAConfig, WgmmaWarpSpecializedConfig)
from .launchers import LauncherTable

__all__ = ["fp4_mm", "LAUNCHERS", "PLANS"]

# config class -> the module (under fp4dispatch.kernels) whose run(a, b, sa, sb, alpha, out, config) launches it
LAUNCHERS: dict[type[KernelConfig], str] = {
    CudaCoreGemvConfig: "gemv.cuda_core",
    BytewiseGemvConfig: "gemv.cuda_core_bytes",
    TmaGemvConfig: "gemv.tma_warp_specialized",
    MmaBf16Config: "gemm.mma_bf16",
    WgmmaRegisterAConfig: "gemm.wgmma_register_a",
    WgmmaWarpSpecializedConfig: "gemm.wgmma_warp_specialized",
    WgmmaDecodeWarpsConfig: "gemm.wgmma_decode_warps",
}
_TABLE = LauncherTable("fp4_mm", "heuristics.configs_for", LAUNCHERS)


def fp4_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
           out: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """``out = alpha * dequant(a) @ dequant(b).T`` on canonical operands (``problem.Operands``: uint8 [rows, K/2]
    codes, 128x4-swizzled e4m3 scales); ``config`` from :func:`~fp4dispatch.kernels.heuristics.configs_for`.

    On a GPU the first call of each (config, M, N, K, out dtype, device) is recorded into a launch plan
    (``plan.py``) and later calls replay it."""
    ops = (a, b, a_scale, b_scale, alpha, out)
    if not out.is_cuda:
        _run(*ops, config)
        return out
    PLANS(ops, config, (id(config), a.shape, b.shape[0], out.dtype, torch._C._cuda_getDevice()))
    return out


def _run(a, b, a_scale, b_scale, alpha, out, config) -> None:
    _TABLE[config](a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), alpha, out, config)


PLANS = plan.Plans("fp4_mm", _run)
