"""``@triton.jit`` code of ``routing_table`` (host side: ``routing_table.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .expert_rows import expert_bounds


@triton.jit
def routing_table_kernel(offs_ptr, out_ptr, T, E, EP: tl.constexpr):
    e, _, ends = expert_bounds(offs_ptr, T, E, EP)
    tl.store(out_ptr + 1 + e, ends, mask=e < E)
    tl.store(out_ptr, 0)
