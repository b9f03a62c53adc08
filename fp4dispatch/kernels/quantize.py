"""Triton NVFP4 quantize kernel, bit-identical to ``format._quantize_torch`` (+ ``swizzle_scales``).

``format.quantize_nvfp4`` calls :func:`quantize` on CUDA when :func:`available` is True. The fp32 arithmetic of the
torch path is the definition; this kernel does the same ops in the same order, with IEEE-rounded division
(``div_rn``) and an integer-only fp32 -> e4m3 round-to-nearest-even (no fp8 instructions, so it also runs on
SM80 and in the interpreter).
"""
from __future__ import annotations

import torch

from . import runtime, workspace
from .target import device_problem
from .runtime import launch

__all__ = ["available", "quantize", "quantize_dynamic", "global_scale"]

_BM, _BKB = 16, 8  # rows x 16-element blocks per program
_AMAX_BLOCK, _AMAX_MAX_PARTS = 2048, 1024  # elements per load of the amax kernel; its programs at most


def available() -> bool:
    """True when the Triton quantize kernel can run on the current CUDA device."""
    if not torch.cuda.is_available():
        return False
    return device_problem(torch.device("cuda", torch.cuda.current_device())) is None


def quantize(x: torch.Tensor, gs: torch.Tensor, swizzled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, contiguous, K % 16 == 0) with float32 [1] global scale ``gs`` ->
    (packed uint8 [M, K/2], float8_e4m3fn scales: swizzled zero-padded [round_up(M,128), round_up(K/16,4)] when
    ``swizzled`` else linear [M, K/16])."""
    from ._quantize import quant_kernel
    m, k = x.shape
    kb = k // 16
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    # swizzled: the kernel writes the padding's zero scales itself (its grid covers the padded layout)
    rp, cp = (-(-m // 128) * 128, -(-kb // 4) * 4) if swizzled else (m, kb)
    sf = torch.empty((rp, cp), dtype=torch.uint8, device=x.device)
    if m and kb:
        grid = (-(-rp // _BM), -(-cp // _BKB))
        launch(quant_kernel, grid, x, gs.reshape(1).float(), packed, sf, m, k, kb, -(-kb // 4), BM=_BM, BKB=_BKB,
               SWIZZLED=swizzled, num_warps=4)
    return packed, sf.view(torch.float8_e4m3fn)


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """``format.default_global_scale(x)`` in one launch (bit-identical; no host sync; graph-safe): float32 [1] of
    contiguous ``x``. Its partial maxima are kept scratch and its arrival counter the stream's self-resetting
    split-K counters (``workspace``), so the launch allocates nothing but the result."""
    from ._quantize import amax_scale_kernel
    n = x.numel()
    gs = torch.empty(1, dtype=torch.float32, device=x.device)
    if n == 0:
        return gs.fill_(1.0)
    progs = min(-(-n // _AMAX_BLOCK), 2 * runtime.num_sms(x.device), _AMAX_MAX_PARTS)
    parts = workspace.scratch("amax", (progs,), torch.float32, x.device)
    launch(amax_scale_kernel, (progs,), x, parts, workspace.counters(1, x.device), gs, n, BLOCK=_AMAX_BLOCK,
           PARTS=1 << (progs - 1).bit_length(), num_warps=4)
    return gs


def quantize_dynamic(x: torch.Tensor, swizzled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` with the global scale ``448*6/amax(x)`` computed on the device first: two launches, the
    same bits as ``format.quantize_nvfp4(x)``'s torch path. Returns (packed, scales, global scale float32 [1])."""
    gs = global_scale(x)
    packed, sf = quantize(x, gs, swizzled)
    return packed, sf, gs
