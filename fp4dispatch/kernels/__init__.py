"""Triton kernels for GPUs without FP4 tensor cores (Hopper, Ada, Ampere): fused NVFP4 GEMM/GEMV, dequantize,
quantize. Every module imports Triton lazily, so ``import fp4dispatch`` never needs it.

``_fused.py`` (with ``_h2.py``) / ``_dequant.py`` hold only ``@triton.jit`` code; ``fused.py`` / ``dequant.py`` /
``quantize.py`` are the host wrappers; ``splitk.py`` (split-K workspace and tile counters) and ``launch.py`` (direct
launches of compiled kernels, less host time per call) serve them. Under ``TRITON_INTERPRET=1`` the kernels run on
CPU tensors (Triton's interpreter), which is how CI tests them.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_missing", "gluon_missing", "interpreting", "jit_interpreted", "cuda_index", "device_problem"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


@functools.cache
def jit_interpreted() -> bool:
    """``interpreting()`` read once: Triton fixes interpret-or-compile when the ``@triton.jit`` functions are defined,
    so the launch paths (per layer, per token) need not read the environment again."""
    return interpreting()


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` ("cuda" means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def triton_missing() -> str | None:
    """Why Triton cannot be used here, or None."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return f"triton is not installed or fails to import ({type(e).__name__}: {e})"
    return None


GLUON_TRITON = "3.6"  # the Triton whose Gluon the kernels of _gluon, _gvws and _wgds are written for (H200: 3.6.0)


@functools.cache
def gluon_missing() -> str | None:
    """Why the Gluon kernels (``_gluon.py``'s wgws, ``_wgds.py``'s wgds and ``_gvws.py``'s gvws: TMA, mbarriers,
    async wgmma, warp specialization) cannot be built with this Triton, or None. Gluon is experimental and its API
    moves between releases, so only the release the kernels were written for and measured with counts (Triton 3.9,
    for one, refuses 64-bit TMA descriptors)."""
    try:
        import triton

        if ".".join(triton.__version__.split(".")[:2]) != GLUON_TRITON:
            return (f"the Gluon kernels (wgws, wgds, gvws) are written for Triton {GLUON_TRITON}'s Gluon; this is "
                    f"Triton {triton.__version__}")
        from . import _gluon, _gvws, _wgds
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return f"triton.experimental.gluon lacks what the Gluon kernels use ({type(e).__name__}: {e})"
    return None


def device_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None."""
    why = triton_missing()
    if why:
        return why
    if device.type == "cpu":
        return None if interpreting() else "needs a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
    if device.type != "cuda":
        return f"needs a CUDA GPU; got device type {device.type!r}"
    if interpreting():
        return "TRITON_INTERPRET=1 is set: the interpreter runs on CPU tensors only"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return f"needs compute capability >= 8.0 (bf16 tensor cores); got {cap[0]}.{cap[1]}"
    return None
