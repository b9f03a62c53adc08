"""``w4a16`` GEMM with the weight decoded in warps of their own (``WgmmaDecodeWarpsW4A16Config``, SM90, Gluon):
``wgmma_decode_warps``' kernel with 16-bit activations. Only imported where
:func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

The decode warps turn the weight into wgmma operand tiles in the activations' dtype by ``wgmma_register_a._dec16``
without CVT (fp16 by bit placement, bf16 by ``numerics/bf16x2.py``: ``e2m1 * e4m3 * 2**-7``, exact), whose K order is
a fixed permutation within each group of 4 blocks; ``wgmma_register_a_w4a16.permute_a`` first writes the activations
in that order (a copy, where the NVFP4 path decodes its activation), and the MMA warpgroup streams them by TMA. Each
product of a 16-bit activation and a weight value is exact in the fp32 accumulator; the epilogue multiplies by 2**7,
then alpha.
"""
from __future__ import annotations

import torch

from .. import runtime
from ..config import WgmmaDecodeWarpsW4A16Config
from .wgmma_decode_warps import check_operands, launch_gemm
from .wgmma_register_a import pdl_after_predecode
from .wgmma_register_a_w4a16 import permute_a


def run(a: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaDecodeWarpsW4A16Config) -> None:
    """Launch ``permute_a``, then ``wgds_kernel`` on its output: a (bf16/fp16 [M, K], contiguous), b uint8 [N, K/2],
    sb its swizzled scales as uint8."""
    check_operands("w4a16_mm", "w4a16_configs_for", b, sb, cfg)
    pre, opts = pdl_after_predecode(runtime.pdl(out.device, cfg.pdl))
    launch_gemm(permute_a(a, pre)[0], b, sb, alpha, out, cfg, opts, w4a16=True)
