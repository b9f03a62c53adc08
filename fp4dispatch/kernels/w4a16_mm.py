"""``w4a16_mm``: ``out = alpha * a @ dequant(b).T`` with a bf16/fp16 as given, by the kernel family a config names
(``heuristics.w4a16_configs_for``); on a GPU through launch plans, as ``fp4_mm``."""
from __future__ import annotations

import torch

from . import plan
from .config import (CudaCoreW4A16Config, KernelConfig, MmaW4A16Config, TmaMmaW4A16Config,
                     WgmmaDecodeWarpsW4A16Config, WgmmaRegisterAW4A16Config, WgmmaWarpSpecializedW4A16Config)
from .launchers import LauncherTable

__all__ = ["w4a16_mm", "LAUNCHERS", "PLANS"]

# config class -> the module (under fp4dispatch.kernels) whose run(a, b, sb, alpha, out, config) launches it
LAUNCHERS: dict[type[KernelConfig], str] = {
    CudaCoreW4A16Config: "gemv.cuda_core_w4a16",
    TmaMmaW4A16Config: "gemv.tma_mma_w4a16",
    MmaW4A16Config: "gemm.mma_w4a16",
    WgmmaRegisterAW4A16Config: "gemm.wgmma_register_a_w4a16",
    WgmmaDecodeWarpsW4A16Config: "gemm.wgmma_decode_warps_w4a16",
    WgmmaWarpSpecializedW4A16Config: "gemm.wgmma_warp_specialized_w4a16",
}
_TABLE = LauncherTable("w4a16_mm", "heuristics.w4a16_configs_for", LAUNCHERS)


def w4a16_mm(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
             config: KernelConfig) -> torch.Tensor:
    """``out = alpha * a @ dequant(b).T``: a bf16/fp16 [M, K] contiguous, b uint8 [N, K/2], b_scale 128x4-swizzled
    e4m3, alpha float32 with one element, out contiguous [M, N]. On a GPU the first call of each (config, M, K,
    activation dtype, N, out dtype, device) is recorded into a launch plan (``plan.py``) and later calls replay
    it."""
    ops = (a, b, b_scale, alpha, out)
    if not out.is_cuda:
        _run(*ops, config)
        return out
    PLANS(ops, config, (id(config), a.shape, a.dtype, b.shape[0], out.dtype, torch._C._cuda_getDevice()))
    return out


def _run(a, b, b_scale, alpha, out, config) -> None:
    _TABLE[config](a, b, b_scale.view(torch.uint8), alpha, out, config)


PLANS = plan.Plans("w4a16_mm", _run)
