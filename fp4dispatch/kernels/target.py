"""What the device and the installed Triton allow: whether the Triton kernels can run at all, and which kernel
families a device gets (the heuristics ask here; the kernel modules never do). Every check imports Triton lazily, so
``import fp4dispatch`` never needs it.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import runtime

__all__ = ["triton_missing", "gluon_missing", "device_problem", "register_a_rank", "gluon_ok", "has_fp8_convert",
           "GLUON_TRITON"]

log = logging.getLogger("fp4dispatch")

GLUON_TRITON = "3.6"  # the Triton whose Gluon the Gluon kernels are written for and were measured with


def triton_missing() -> str | None:
    """Why Triton cannot be used here, or None."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return f"triton is not installed or fails to import ({type(e).__name__}: {e})"
    return None


@functools.cache
def gluon_missing() -> str | None:
    """Why the Gluon kernels (``gemm.wgmma_warp_specialized``, ``gemm.wgmma_decode_warps``,
    ``gemv.tma_warp_specialized``, its grouped form and ``gemv.tma_mma_w4a16``: TMA, mbarriers, async wgmma, warp
    specialization) cannot be built with this Triton, or None. Gluon is experimental and its API moves between
    releases, so only the release the kernels were written for counts (Triton 3.9, for one, refuses 64-bit TMA
    descriptors)."""
    try:
        import triton

        if ".".join(triton.__version__.split(".")[:2]) != GLUON_TRITON:
            return (f"the Gluon kernels (wgmma_warp_specialized, wgmma_decode_warps, tma_warp_specialized) are "
                    f"written for Triton {GLUON_TRITON}'s Gluon; this is Triton {triton.__version__}")
        from .gemm import wgmma_decode_warps, wgmma_warp_specialized  # noqa: F401
        from .gemv import tma_mma_w4a16, tma_warp_specialized, tma_warp_specialized_grouped  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return f"triton.experimental.gluon lacks what the Gluon kernels use ({type(e).__name__}: {e})"
    return None


def device_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None."""
    why = triton_missing()
    if why:
        return why
    if device.type == "cpu":
        return None if runtime.interpreting() else "needs a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
    if device.type != "cuda":
        return f"needs a CUDA GPU; got device type {device.type!r}"
    if runtime.interpreting():
        return "TRITON_INTERPRET=1 is set: the interpreter runs on CPU tensors only"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return f"needs compute capability >= 8.0 (bf16 tensor cores); got {cap[0]}.{cap[1]}"
    return None


def has_fp8_convert(device: torch.device) -> bool:
    """cvt.rn.f16x2.e4m3x2 exists on SM89+ (Ada, Hopper, Blackwell); not on Ampere, not in the interpreter."""
    if device.type != "cuda" or runtime.jit_interpreted():
        return False
    return torch.cuda.get_device_capability(runtime.cuda_index(device)) >= (8, 9)


def register_a_rank(device: torch.device) -> int:
    """Where ``gemm.wgmma_register_a`` goes in the candidate list. 0: not offered (its scale decode needs
    cvt.rn.f16x2.e4m3x2, SM89+); 1: after the older kernels; 2: first (SM90: the weight stays in registers as the
    wgmma operand). The interpreter offers it (CI)."""
    if device.type != "cuda":
        return 1 if runtime.jit_interpreted() else 0
    if runtime.jit_interpreted():
        return 0
    cap = torch.cuda.get_device_capability(runtime.cuda_index(device))
    return 2 if cap[0] == 9 else 1 if cap >= (8, 9) else 0


def gluon_ok(device: torch.device) -> bool:
    """The Gluon kernels need SM90 itself (wgmma, TMA, setmaxnreg: sm_90a; Blackwell has none of them), compiled
    kernels (``register_a_rank`` 2 says both) and a Triton whose Gluon has what they use."""
    if register_a_rank(device) != 2:
        return False
    why = gluon_missing()
    if why:
        log.debug("fp4dispatch: no Gluon kernel configs: %s", why)
    return why is None
