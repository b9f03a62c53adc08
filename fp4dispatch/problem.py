"""The canonical form of one ``fp4_mm`` call, as every backend receives it."""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Problem", "Operands", "GroupedOperands", "OUT_DTYPES", "m_bucket", "M_BUCKETS"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# M buckets: powers of two up to 8192 (chosen from a measurement; see docs/tuning.md). A bucket is named by its
# upper edge; M is rounded up to the next edge, and anything above the last edge shares the last bucket.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def m_bucket(m: int) -> int:
    """The bucket (upper edge) that M belongs to."""
    if m > 8192:
        return 8192
    return 1 << (m - 1).bit_length() if m > 1 else 1


class Problem(NamedTuple):
    """Shape and type of one GEMM: out[M, N] = alpha * A[M, K] @ B[N, K].T (K in elements). ``a_dtype`` says which
    op it is: ``torch.uint8`` (packed NVFP4 activations: ``fp4_mm``) or bf16/fp16 (activations as they are:
    ``w4a16_mm``). ``experts`` > 0 makes it ``fp4_grouped_mm`` (``w4a16_grouped_mm`` with bf16/fp16 activations):
    M is then T, the tokens of all E experts together, and B is [E, N, K] (each expert multiplies the rows ``offs``
    gives it)."""

    m: int
    n: int
    k: int
    out_dtype: torch.dtype
    device: torch.device
    a_dtype: torch.dtype = torch.uint8
    experts: int = 0

    @property
    def bucket(self) -> int:
        return m_bucket(self.m)

    @property
    def op(self) -> str:
        if self.experts:
            return "grouped" if self.a_dtype is torch.uint8 else "w4a16_grouped"
        return "fp4_mm" if self.a_dtype is torch.uint8 else "w4a16"

    @property
    def call(self) -> str:
        """The public function of this op, as messages name it."""
        if self.experts:
            return "fp4_grouped_mm" if self.a_dtype is torch.uint8 else "w4a16_grouped_mm"
        return "fp4_mm" if self.a_dtype is torch.uint8 else "w4a16_mm"

    @property
    def key(self) -> tuple:
        """What one decision serves: (device, M bucket, N, K, out dtype, activation dtype, experts)."""
        return (self.device, m_bucket(self.m), self.n, self.k, self.out_dtype, self.a_dtype, self.experts)

    def with_m(self, m: int) -> "Problem":
        return self._replace(m=m)

    def __str__(self) -> str:
        text = f"M={self.m} N={self.n} K={self.k} out={str(self.out_dtype).replace('torch.', '')}"
        if self.experts:
            text = f"T={self.m} E={self.experts} " + text.split(" ", 1)[1]
        return text if self.a_dtype is torch.uint8 else f"{text} a={str(self.a_dtype).replace('torch.', '')} (w4a16)"


class Operands(NamedTuple):
    """Canonical operands: a uint8 [M, K/2], b uint8 [N, K/2] (both contiguous), 2-D 128x4-swizzled zero-padded
    float8_e4m3fn scales, alpha float32 with one element ([1] or 0-d) on the device, and a preallocated contiguous
    out [M, N]. For ``w4a16_mm`` ``a`` is the bf16/fp16 [M, K] activation and ``a_scale`` an empty e4m3 tensor."""

    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor
    alpha: torch.Tensor
    out: torch.Tensor


class GroupedOperands(NamedTuple):
    """``fp4_grouped_mm``'s canonical operands: ``a`` uint8 [T, K/2], ``b`` uint8 [E, N, K/2], ``a_scale`` and
    ``b_scale`` in the grouped swizzled layout (fp4dispatch/format.py, docs/contract.md), ``alpha`` float32 [E],
    ``out`` [T, N], ``offs`` int32 [E] (cumulative end row of each expert), all contiguous on one device."""

    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor
    alpha: torch.Tensor
    out: torch.Tensor
    offs: torch.Tensor
