"""``routing_table``: ``offs`` (each expert's cumulative end row) as a table of each expert's first row and then the
end, int32 [E+1], clamped to [0, T] and made non-decreasing on the GPU (``expert_rows.expert_bounds``), for kernels
that take that form and trust it (Humming's grouped GEMM). One small launch, no host sync."""
from __future__ import annotations

import torch

from .runtime import launch

__all__ = ["routing_table"]


def routing_table(offs: torch.Tensor, t: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (int32 [E+1]) = [0, clamped offs...] for ``t`` rows."""
    from ._routing_table import routing_table_kernel

    e = offs.numel()
    launch(routing_table_kernel, (1,), offs, out, t, e, EP=max(16, 1 << (e - 1).bit_length()), num_warps=4)
    return out
