"""Host side of the Triton NVFP4 dequantize kernel: canonical packed rows + swizzled scales -> dense bf16/fp16."""
from __future__ import annotations

import torch

from . import workspace
from .runtime import launch

__all__ = ["dequantize_rows", "dequantize_to_scratch", "dequantize_grouped_rows", "DEQUANT_BLOCK"]

DEQUANT_BLOCK = (16, 16)  # (rows, 16-element blocks) per program: 16 x 256 values, 2 KB of packed input


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                    factor: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize uint8 [R, K/2] with 128x4-swizzled e4m3 scales to [R, K] of ``dtype`` (bf16 or fp16).

    Without ``factor`` the result is exact (every e2m1 x e4m3 product fits bf16/fp16). With ``factor`` (a float32
    [1] tensor, e.g. alpha) each value is multiplied by it in fp32 before the cast, which rounds once.
    """
    from ._dequant import dequant_kernel

    r, k2 = packed.shape
    kb = k2 // 8
    if out is None:
        out = torch.empty((r, k2 * 2), dtype=dtype, device=packed.device)
    br, bkb = DEQUANT_BLOCK
    grid = (-(-r // br), -(-kb // bkb))
    f = factor if factor is not None else scale  # any pointer: unused when HAS_F is False
    launch(dequant_kernel, grid, packed, scale.view(torch.uint8), f, out, r, k2, kb, -(-kb // 4), BR=br, BKB=bkb,
           HAS_F=factor is not None, num_warps=4)
    return out


def dequantize_to_scratch(purpose: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          factor: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dequantize_rows` into the kept scratch of ``purpose`` (``workspace.scratch``): for an operand that a
    backend only reads within its call, so that the call allocates nothing."""
    out = workspace.scratch(purpose, (packed.shape[0], packed.shape[1] * 2), dtype, packed.device)
    return dequantize_rows(packed, scale, dtype, factor=factor, out=out)


def dequantize_grouped_rows(packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                            layout: torch.Tensor, k_order: bool = False) -> torch.Tensor:
    """``fp4_grouped_mm``'s activations, uint8 [T, K/2] with scales in the grouped swizzled layout for ``offs``
    (int32 [E]), to ``out`` [T, K] bf16/fp16, exact, in one launch that also writes ``layout`` (int32 [E+1]): 0 and
    then ``offs`` clamped to [0, T] and made non-decreasing (what a kernel that trusts its routing table may
    read). Rows that no expert owns (a wrong table) decode to zero. No host sync: graph-safe. With ``k_order``,
    ``out`` is [T, ceil(K/64)*64] in the register-operand decode's K order (``wgmma_register_a.to_k_order``, zeros
    past K): what ``wgmma_register_a_w4a16.permute_a`` makes of the plain rows, without its launch."""
    from ._dequant import grouped_dequant_kernel

    t, k2 = packed.shape
    kb = k2 // 8
    e = offs.numel()
    br, bkb = DEQUANT_BLOCK
    grid = (max(1, -(-t // br)), -(-kb // bkb))
    launch(grouped_dequant_kernel, grid, packed, scale.view(torch.uint8), offs, out, layout, t, k2, kb, -(-kb // 4),
           e, out.shape[1], BR=br, BKB=bkb, EP=max(16, 1 << (e - 1).bit_length()), KORDER=k_order, num_warps=4)
    return out
