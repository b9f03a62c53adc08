"""Triton NVFP4 quantize kernel, bit-identical to ``format._quantize_torch`` (+ ``swizzle_scales``).

``format.quantize_nvfp4`` calls :func:`quantize` on CUDA when :func:`available` is True. The fp32 arithmetic of the
torch path is the definition; this kernel does the same ops in the same order, with IEEE-rounded division
(``div_rn``) and an integer-only fp32 -> e4m3 round-to-nearest-even (no fp8 instructions, so it also runs on
SM80 and in the interpreter).
"""
from __future__ import annotations

import torch

from .target import device_problem
from .runtime import launch

__all__ = ["available", "quantize"]

_BM, _BKB = 16, 8  # rows x 16-element blocks per program


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
    if swizzled:
        rp, cp = -(-m // 128) * 128, -(-kb // 4) * 4
        sf = torch.zeros((rp, cp), dtype=torch.uint8, device=x.device)  # padding must read as zero scales
    else:
        sf = torch.empty((m, kb), dtype=torch.uint8, device=x.device)
    if m and kb:
        grid = (-(-m // _BM), -(-kb // _BKB))
        launch(quant_kernel, grid, x, gs.reshape(1).float(), packed, sf, m, k, kb, -(-kb // 4), BM=_BM, BKB=_BKB,
               SWIZZLED=swizzled, num_warps=4)
    return packed, sf.view(torch.float8_e4m3fn)
