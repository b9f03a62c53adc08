"""``w4a16`` GEMM, warp-specialized (``WgmmaWarpSpecializedW4A16Config``, SM90, Gluon): ``wgmma_warp_specialized``'s
kernel with 16-bit activations. Only imported where :func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

The consumers decode the weight words straight into the wgmma register operand in the activations' dtype, by
``wgmma_register_a._dec16`` without CVT (fp16 by bit placement, bf16 by ``numerics/bf16x2.py``: ``e2m1 * e4m3 *
2**-7``, exact); ``wgmma_register_a_w4a16.permute_a`` first writes the activations in that decode's K order (a copy,
where the NVFP4 GEMM decodes its activation), and the producer warp streams them by TMA. Each product of a 16-bit
activation and a weight value is exact in the fp32 accumulator; the epilogue multiplies by 2**7, then alpha. There is
no swapped form: the operand decoded first would be the weight, i.e. ``triton:dequant+matmul``'s whole dequantize.
"""
from __future__ import annotations

import torch

from .. import runtime
from ..config import WgmmaWarpSpecializedW4A16Config
from .wgmma_register_a import pdl_after_predecode
from .wgmma_register_a_w4a16 import permute_a
from .wgmma_warp_specialized import check_operand, launch_gemm


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaWarpSpecializedW4A16Config) -> None:
    """Launch ``permute_a``, then ``wgws_kernel`` on its output: a (bf16/fp16 [M, K], contiguous), b uint8 [N, K/2],
    sb its swizzled scales as uint8."""
    check_operand("w4a16_mm", "w4a16_configs_for", "b", b, cfg)
    # with PDL only the producer waits for the permute
    pre, opts = pdl_after_predecode(runtime.pdl(out.device, cfg.pdl))
    launch_gemm(b, sb, permute_a(a, pre)[0], alpha, out, cfg, opts, w4a16=True)
