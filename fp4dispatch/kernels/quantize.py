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

_PADB = 32  # zero scale rows per store of the swizzled layout's row padding
# the amax kernel: elements per load, programs per SM and at most (enough loads in flight to read at HBM speed),
# warps; for a small input whose partial maxima the quantize kernel reduces, fewer programs (each quantize program
# loads all of them)
_AMAX_BLOCK, _AMAX_PER_SM, _AMAX_MAX_PARTS, _AMAX_WARPS = 2048, 8, 2048, 8
_SMALL_AMAX, _SMALL_AMAX_ELEMENTS = (2048, 2, 8), 1 << 22


def available() -> bool:
    """True when the Triton quantize kernel can run on the current CUDA device."""
    if not torch.cuda.is_available():
        return False
    return device_problem(torch.device("cuda", torch.cuda.current_device())) is None


def quant_tile(m: int) -> tuple[int, int, int]:
    """(rows, 16-element blocks, warps) of one quantize program for ``m`` rows: the fastest tile of a sweep on the
    H200 (docs/kernels.md, "The activation quantize"), within a few % of each M's best."""
    if m <= 2:
        return 1, 16, 4
    if m <= 128:
        return 4, 16, 4
    return 8, 16, 2


def quantize(x: torch.Tensor, gs: torch.Tensor, swizzled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, contiguous, K % 16 == 0) with float32 [1] global scale ``gs`` ->
    (packed uint8 [M, K/2], float8_e4m3fn scales: swizzled zero-padded [round_up(M,128), round_up(K/16,4)] when
    ``swizzled`` else linear [M, K/16])."""
    return _quantize(x, gs.reshape(1).float(), swizzled, None)


def _quantize(x: torch.Tensor, gs: torch.Tensor, swizzled: bool, parts: torch.Tensor | None):
    """:func:`quantize`; with ``parts`` (the amax kernel's partial maxima, FINISH off) the kernel derives the global
    scale from them and writes it into ``gs``."""
    from ._quantize import quant_kernel
    m, k = x.shape
    kb = k // 16
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    # swizzled: the kernel writes the padding's zero scales itself (its grid covers the padded layout)
    rp, cp = (-(-m // 128) * 128, -(-kb // 4) * 4) if swizzled else (m, kb)
    sf = torch.empty((rp, cp), dtype=torch.uint8, device=x.device)
    if m and kb:
        bm, bkb, warps = quant_tile(m)
        nparts = 0 if parts is None else parts.numel()
        launch(quant_kernel, (-(-m // bm), -(-cp // bkb)), x, gs, gs if parts is None else parts, nparts, packed, sf,
               m, k, kb, -(-kb // 4), rp, BM=bm, BKB=bkb, SWIZZLED=swizzled, PADB=_PADB,
               PARTS=nparts and 1 << (nparts - 1).bit_length(), num_warps=warps)
    return packed, sf.view(torch.float8_e4m3fn)


def _amax(x: torch.Tensor, gs: torch.Tensor, finish: bool) -> torch.Tensor:
    """Launch the amax kernel on ``x`` (numel > 0); returns its partial maxima. ``finish``: it also writes ``gs``."""
    from ._quantize import amax_scale_kernel
    n = x.numel()
    block, per_sm, warps = (_AMAX_BLOCK, _AMAX_PER_SM, _AMAX_WARPS) if finish else _SMALL_AMAX
    progs = min(-(-n // block), per_sm * runtime.num_sms(x.device), _AMAX_MAX_PARTS)
    parts = workspace.scratch("amax", (progs,), torch.float32, x.device)
    cnt = workspace.counters(1, x.device) if finish else parts  # without FINISH the kernel does not count
    launch(amax_scale_kernel, (progs,), x, parts, cnt, gs, n, BLOCK=block, PARTS=1 << (progs - 1).bit_length(),
           FINISH=finish, num_warps=warps)
    return parts


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """``format.default_global_scale(x)`` in one launch (bit-identical; no host sync; graph-safe): float32 [1] of
    contiguous ``x``. Its partial maxima are kept scratch and its arrival counter the stream's self-resetting
    split-K counters (``workspace``), so the launch allocates nothing but the result."""
    gs = torch.empty(1, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return gs.fill_(1.0)
    _amax(x, gs, finish=True)
    return gs


def quantize_dynamic(x: torch.Tensor, swizzled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` with the global scale ``448*6/amax(x)`` computed on the device first: two launches, the
    same bits as ``format.quantize_nvfp4(x)``'s torch path. Returns (packed, scales, global scale float32 [1]).
    A small ``x`` (at most ``_SMALL_AMAX_ELEMENTS``): the quantize kernel reduces the amax kernel's partial maxima
    itself, which spares the amax launch its last program's atomic and second round trip."""
    if x.numel() == 0 or x.numel() > _SMALL_AMAX_ELEMENTS:
        gs = global_scale(x)
        packed, sf = quantize(x, gs, swizzled)
        return packed, sf, gs
    gs = torch.empty(1, dtype=torch.float32, device=x.device)
    packed, sf = _quantize(x, gs, swizzled, _amax(x, gs, finish=False))
    return packed, sf, gs
