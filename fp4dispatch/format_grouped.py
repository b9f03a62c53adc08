"""The block-scale layouts of ``fp4_grouped_mm`` (the MoE expert GEMM), drawn in docs/contract.md.

Rows are grouped by expert: ``offs`` (int32 [E], torch ``_grouped_mm``'s convention) holds each expert's cumulative
end row, so expert e owns rows ``[offs[e-1], offs[e])`` of ``a`` (``offs[-1]`` is 0) and may own none.

  * ``"linear"``: ``a_scale`` [T, K/16] (row t scales a's row t), ``b_scale`` [E, N, K/16].
  * ``"swizzled"`` (what native grouped NVFP4 kernels read: torch's ``scaled_grouped_mm`` through FBGEMM, vLLM's and
    SGLang's ``cutlass_fp4_group_mm`` with their ``blockscale_offsets``): ``b_scale`` [E, round_up(N,128),
    round_up(K/16,4)], each expert its own zero-padded 128x4-swizzled matrix; ``a_scale`` [S, round_up(K/16,4)],
    expert e's scales swizzled as their own matrix of round_up(rows_e, 128) rows that starts at row
    ``P[e] = sum_{j<e} round_up(rows_j, 128)`` (an expert without rows takes none). S >= P[E] holds the routing;
    ``grouped_scale_rows(T, E)`` rows hold any routing of T rows (allocate that many when the routing is not known
    on the host, as in a CUDA graph).

All helpers here run on the device without a host sync, so they may be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from .errors import InvalidInputError
from .format import BLOCK, swizzle_scales, unswizzle_scales

__all__ = ["grouped_scale_rows", "scale_starts", "swizzle_grouped_scales", "unswizzle_grouped_scales",
           "swizzle_expert_scales", "unswizzle_expert_scales", "expert_of_rows", "padded_rows", "rows_per_expert",
           "dequantize_grouped"]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def grouped_scale_rows(t: int, e: int) -> int:
    """Rows of a swizzled ``a_scale`` that hold any routing of ``t`` rows over ``e`` experts: each of the at most
    min(e, t) experts with rows pads its rows by at most 127, and the sum is a multiple of 128."""
    return (t + 127 * min(e, t)) // 128 * 128


def rows_per_expert(offs: torch.Tensor) -> torch.Tensor:
    """Each expert's rows (int64 [E]) of the routing ``offs`` (cumulative end rows)."""
    ends = offs.long()
    return torch.diff(ends, prepend=ends.new_zeros(1))


def scale_starts(offs: torch.Tensor) -> torch.Tensor:
    """``P`` (int64 [E+1]): expert e's activation scales start at row P[e] of a swizzled ``a_scale``; P[E] is the
    rows the routing needs."""
    return torch.nn.functional.pad(torch.cumsum((rows_per_expert(offs) + 127) // 128 * 128, 0), (1, 0))


def expert_of_rows(offs: torch.Tensor, t: int) -> torch.Tensor:
    """The expert of each of the ``t`` rows (int64 [t])."""
    return torch.searchsorted(offs.long(), torch.arange(t, device=offs.device), right=True)


def padded_rows(offs: torch.Tensor, t: int) -> torch.Tensor:
    """Row of each token row's scales in the swizzled layout: P[expert] + its row inside the expert."""
    ends = offs.long()
    # clamped: rows past offs[-1] (a wrong table, refused by fp4_grouped_mm unless offs is not read) stay in bounds
    eid = expert_of_rows(offs, t).clamp_(max=max(offs.numel() - 1, 0))
    first = torch.nn.functional.pad(ends, (1, 0))[eid]  # the expert's first row
    return scale_starts(offs)[eid] + torch.arange(t, device=offs.device) - first


def _scales(who: str, linear: object, want: str) -> torch.Tensor:
    """``linear`` as block scales (float8_e4m3fn, or its uint8 bytes), or the error naming ``who``'s argument."""
    if not isinstance(linear, torch.Tensor) or linear.dtype not in (torch.float8_e4m3fn, torch.uint8):
        got = f"dtype={linear.dtype}" if isinstance(linear, torch.Tensor) else type(linear).__name__
        raise InvalidInputError(f"{who}: linear must be a float8_e4m3fn (or uint8 bytes) tensor of block scales "
                                f"{want}; got {got}. Pass the scales as quantize_nvfp4(..., scale_layout='linear') "
                                "returns them")
    return linear


def swizzle_grouped_scales(linear: torch.Tensor, offs: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Linear activation scales [T, K/16] -> the swizzled grouped layout [rows, round_up(K/16,4)] for ``offs``
    (``rows`` default: ``grouped_scale_rows(T, E)``, which holds any routing)."""
    linear = _scales("swizzle_grouped_scales", linear, "[T, K/16]")
    if not isinstance(offs, torch.Tensor) or offs.is_floating_point() or offs.dtype == torch.bool:
        raise InvalidInputError(f"swizzle_grouped_scales: offs must be an integer tensor [E] of cumulative end rows; "
                                f"got {type(offs).__name__ if not isinstance(offs, torch.Tensor) else offs.dtype}. "
                                "Build it as torch.cumsum(rows_per_expert, 0).to(torch.int32)")
    if linear.dim() != 2 or offs.dim() != 1:
        raise InvalidInputError(f"swizzle_grouped_scales: expected linear [T, K/16] and offs [E]; got linear.shape="
                                f"{tuple(linear.shape)}, offs.shape={tuple(offs.shape)}")
    t, cols = linear.shape
    rows = grouped_scale_rows(t, offs.numel()) if rows is None else rows
    if rows % 128:
        raise InvalidInputError(f"swizzle_grouped_scales: rows must be a multiple of 128; got {rows}")
    u8 = linear.view(torch.uint8) if linear.dtype != torch.uint8 else linear
    padded = torch.zeros((max(rows, 128), cols), dtype=torch.uint8, device=linear.device)
    padded.index_copy_(0, padded_rows(offs, t).clamp_(0, padded.shape[0] - 1), u8)
    # every expert's block starts at a multiple of 128, and the swizzle permutes within 128-row tiles: swizzling the
    # padded matrix whole swizzles each block as its own matrix
    out = swizzle_scales(padded)[:rows]
    return out.view(linear.dtype) if linear.dtype != torch.uint8 else out


def unswizzle_grouped_scales(swizzled: torch.Tensor, offs: torch.Tensor, t: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_grouped_scales`: [S, round_up(cols,4)] -> linear [t, cols]."""
    s = swizzled.shape[0]
    lin = unswizzle_scales(swizzled, s, _round_up(cols, 4))[:, :cols] if s else swizzled[:, :cols]
    return lin[padded_rows(offs, t)] if t else lin[:0]


def swizzle_expert_scales(linear: torch.Tensor) -> torch.Tensor:
    """Weight scales [E, N, K/16] -> [E, round_up(N,128), round_up(K/16,4)], each expert 128x4-swizzled (vLLM's
    ``swizzle_blockscale``)."""
    linear = _scales("swizzle_expert_scales", linear, "[E, N, K/16]")
    if linear.dim() != 3:
        raise InvalidInputError(f"swizzle_expert_scales: expected [E, N, K/16]; got shape={tuple(linear.shape)}")
    e, n, cols = linear.shape
    rn = _round_up(n, 128)
    padded = torch.zeros((e, rn, cols), dtype=linear.dtype, device=linear.device)
    padded[:, :n] = linear
    return swizzle_scales(padded.reshape(e * rn, cols)).reshape(e, rn, _round_up(cols, 4))


def unswizzle_expert_scales(swizzled: torch.Tensor, n: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_expert_scales`: -> [E, N, cols]."""
    e = swizzled.shape[0]
    rn, cp = _round_up(n, 128), _round_up(cols, 4)
    return unswizzle_scales(swizzled.reshape(e * rn, cp), e * rn, cp).reshape(e, rn, cp)[:, :n, :cols].contiguous()


def dequantize_grouped(a: torch.Tensor, a_scale: torch.Tensor, offs: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed activations [T, K/2] with swizzled grouped scales -> [T, K] ``dtype`` (exact)."""
    from .format import dequantize_nvfp4

    t, k = a.shape[0], a.shape[1] * 2
    lin = unswizzle_grouped_scales(a_scale, offs, t, k // BLOCK)
    return dequantize_nvfp4(a, lin, scale_layout="linear", dtype=dtype)
