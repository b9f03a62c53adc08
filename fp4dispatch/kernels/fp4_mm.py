"""``fp4_mm``: ``out = alpha * dequant(a) @ dequant(b).T`` with the kernel family a config names.

A table maps each config class to its family's launcher (``run`` in the family's module). The modules import Triton
(the Gluon ones, Gluon) when loaded, so each is imported the first time a config of its family runs.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..errors import InvalidInputError
from .config import (BytewiseGemvConfig, CudaCoreGemvConfig, KernelConfig, MmaBf16Config, TmaGemvConfig,
                     WgmmaDecodeWarpsConfig, WgmmaRegisterAConfig, WgmmaWarpSpecializedConfig)

__all__ = ["fp4_mm", "LAUNCHERS"]

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
_RUN: dict[type, Callable] = {}


def _launcher(kind: type) -> Callable:
    if kind not in LAUNCHERS:
        raise InvalidInputError(f"fp4_mm: config must be one of {', '.join(c.__name__ for c in LAUNCHERS)} (from "
                                f"heuristics.configs_for); got {kind.__name__}")
    run = _RUN[kind] = importlib.import_module(f"{__package__}.{LAUNCHERS[kind]}").run
    return run


def fp4_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
           out: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """``out = alpha * dequant(a) @ dequant(b).T`` on canonical operands (``problem.Operands``: uint8 [rows, K/2]
    codes, 128x4-swizzled e4m3 scales); ``config`` from :func:`~fp4dispatch.kernels.heuristics.configs_for`."""
    run = _RUN.get(type(config)) or _launcher(type(config))
    run(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), alpha, out, config)
    return out
