"""``fp4_mm``: ``out = alpha * dequant(a) @ dequant(b).T`` with the kernel family a config names.

A table maps each config class to its family's launcher (``run`` in the family's module). The modules import Triton
(the Gluon ones, Gluon) when loaded, so each is imported the first time a config of its family runs.
"""
from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

from ..errors import InvalidInputError
from . import plan, runtime
from .config import (BytewiseGemvConfig, CudaCoreGemvConfig, KernelConfig, MmaBf16Config, TmaGemvConfig,
                     WgmmaDecodeWarpsConfig, WgmmaRegisterAConfig, WgmmaWarpSpecializedConfig)

__all__ = ["fp4_mm", "LAUNCHERS", "MAX_PLANS"]

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
MAX_PLANS = 1024
_PLANS: dict[tuple, tuple] = {}  # (id(config), a.shape, N, out dtype, device index) -> (config, Plan or None)
log = logging.getLogger("fp4dispatch")


def _launcher(kind: type) -> Callable:
    if kind not in LAUNCHERS:
        raise InvalidInputError(f"fp4_mm: config must be one of {', '.join(c.__name__ for c in LAUNCHERS)} (from "
                                f"heuristics.configs_for); got {kind.__name__}")
    run = _RUN[kind] = importlib.import_module(f"{__package__}.{LAUNCHERS[kind]}").run
    return run


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
    key = (id(config), a.shape, b.shape[0], out.dtype, torch._C._cuda_getDevice())
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is config:  # the config is held by the entry, so its id is not reused meanwhile
        if hit[1] is None or not _replay(key, hit, ops):
            _run(*ops, config)
        return out
    if runtime.jit_interpreted() or runtime.compiling_ahead() or plan.unplannable(ops):
        _run(*ops, config)
        return out
    rec = plan.record(lambda: _run(*ops, config))
    new, why = plan.build(rec, ops, config, torch.device("cuda", key[-1]))
    if new is None:
        log.debug("fp4dispatch: no launch plan for %s at M=%d N=%d: %s", config, a.shape[0], b.shape[0], why)
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))  # the oldest: plans of configs tried while tuning come first
    _PLANS[key] = (config, new)
    return out


def _replay(key: tuple, hit: tuple, ops: tuple) -> bool:
    """Replay a plan; if its launcher raises (a Triton whose launcher wants other arguments), drop the plan of this
    key and say so: the caller then takes the ordinary path, which relaunches every kernel (their writes are the
    same), and raises if the kernel itself cannot be launched."""
    try:
        return hit[1](*ops)
    except Exception as e:  # noqa: BLE001 - any launcher failure: the ordinary path decides
        _PLANS[key] = (hit[0], None)
        log.warning("fp4dispatch: the launch plan of %s failed (%s: %s); this key launches through Triton from now on",
                    hit[0], type(e).__name__, e)
        return False


def _run(a, b, a_scale, b_scale, alpha, out, config) -> None:
    run = _RUN.get(type(config)) or _launcher(type(config))
    run(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), alpha, out, config)
