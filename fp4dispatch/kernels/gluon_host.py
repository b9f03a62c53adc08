"""Host side of the Gluon kernels (SM90 with Triton 3.6): the checks their TMA boxes and rings need, then the launch.
``wgws`` (``_gluon.py``), ``gvws`` (``_gvws.py``) and ``wgds`` (``_wgds.py``); the kernel modules import Gluon, so
they are imported here only when a config of theirs runs (``fused.fused_mm``). Which configs are offered, and where:
``fused.configs_for``.
"""
from __future__ import annotations

import torch

from .fused import _cdiv, _num_sms, gluon_pdl, predecode
from .launch import launch, tma_desc


def run_wgws(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor,
             out: torch.Tensor, config: dict, pdl: dict) -> None:
    """``wgws`` (``_gluon.py``, SM90): one operand decoded once to fp16 (wmma's APRE step), then one launch over TMA
    descriptors of the other's words and the decoded one. The decoded one is A, or with ``swap`` the weight (out =
    A @ W.T tile by tile: fewer values to decode where M > N)."""
    kb = a.shape[1] // 8
    swap = bool(config.get("swap"))
    x, sx, y, sy = (a, sa, b, sb) if swap else (b, sb, a, sa)  # x: decoded in registers, y: decoded first
    if kb % 2 or x.data_ptr() % 16:  # TMA: 16-byte aligned base and row stride
        raise ValueError(f"fused_mm: wgws needs K % 32 == 0 and a 16-byte aligned {'a' if swap else 'b'}; got "
                         f"K={kb * 16}, data_ptr() % 16 = {x.data_ptr() % 16}. Use another config from configs_for()")
    cb = _cdiv(kb, 4)
    nx, ny = x.shape[0], y.shape[0]
    pre, opts = gluon_pdl(pdl)  # with PDL only wgws's producer waits for the pre-decode
    yd = predecode(y.view(torch.int64), sy, True, CVT=True, **pre)
    from . import _gluon

    bm, bn, bkb, stages = (int(config[key]) for key in ("BM", "BN", "BKB", "stages"))
    x_layout, y_layout = _gluon.layouts(bn, bm, bkb)
    x_desc = tma_desc(x.data_ptr(), torch.int64, (nx, kb), (kb, 1), (bn, bkb), x_layout)
    y_desc = tma_desc(yd.data_ptr(), yd.dtype, tuple(yd.shape), yd.stride(), (bm, bkb * 16), y_layout)
    nt, steps = _cdiv(nx, bn), _cdiv(kb, bkb)
    tiles = nt * _cdiv(ny, bm)
    # persist: one CTA per SM (the ring fills its shared memory), whole tiles each, so that the loads run on across
    # a tile's epilogue; else one CTA per tile
    ctas = min(tiles, _num_sms(out.device)) if config.get("persist") else tiles
    launch(_gluon.wgws_kernel, (ctas,), x_desc, y_desc, sx, alpha, out, ny, nx, kb, cb, nt, tiles, steps, BN=bn,
           BM=bm, BKB=bkb, STAGES=stages, SWAP=swap, num_warps=bn // 16, **opts)


def run_gvws(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor,
             out: torch.Tensor, config: dict) -> None:
    """``gvws`` (``_gvws.py``, SM90, M <= MB <= 2), after the checks its TMA boxes need."""
    m, n, kb = a.shape[0], b.shape[0], a.shape[1] // 8
    if m > int(config["MB"]) or n % 32 or kb % 2 or any(t.data_ptr() % 16 for t in (a, b, sa, sb)):
        raise ValueError(f"fused_mm: gvws needs M <= MB, N % 32 == 0, K % 32 == 0 and 16-byte aligned operands; got "
                         f"M={m}, MB={config['MB']}, N={n}, K={kb * 16}, data_ptr() % 16 of (a, b, a_scale, b_scale) = "
                         f"{tuple(t.data_ptr() % 16 for t in (a, b, sa, sb))}. Use another config from configs_for()")
    from . import _gvws

    _gvws.run(a, b, sa, sb, alpha, out, config, _num_sms(out.device))


def run_wgds(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor,
             out: torch.Tensor, config: dict, pdl: dict) -> None:
    """``wgds`` (``_wgds.py``, SM90), after the checks of its rings and TMA boxes."""
    n, kb = b.shape[0], b.shape[1] // 8
    rings = {key: int(config.get(key, 0)) for key in ("stages", "astages", "dstages")}
    parts, bn = int(config.get("parts", 0)), int(config.get("BN", 0))
    # a ring of one slot deadlocks (the MMA frees a step's slots after issuing the next); a decode partition runs
    # `parts` steps ahead. A weight slot must go to the same partition every time (stages % parts == 0): a partition
    # that finds the slot's previous load, another partition's, still in flight passes its phase wait at once (the
    # parity is the one before), decodes stale words and frees the slot twice (3 stages with 2 partitions: unspecified
    # launch failure on the H200, thirteenth session). BN 128 with two partitions of 8 decode warps failed to compile
    # (too few registers)
    if parts not in (1, 2) or min(rings.values()) < max(2, parts) or rings["stages"] % parts or bn != 64:
        raise ValueError(f"fused_mm: wgds needs BN 64, parts 1 or 2, rings of >= max(2, parts) slots and stages a "
                         f"multiple of parts; got BN={bn}, parts={parts}, {rings}. Use a config from configs_for()")
    if n % 32 or kb % 2 or b.data_ptr() % 16 or sb.data_ptr() % 16:
        raise ValueError(f"fused_mm: wgds needs N % 32 == 0, K % 32 == 0 and a 16-byte aligned b and b_scale; got "
                         f"N={n}, K={kb * 16}, data_ptr() % 16 of (b, b_scale) = "
                         f"{(b.data_ptr() % 16, sb.data_ptr() % 16)}. Use another config from configs_for()")
    from . import _wgds

    _wgds.run(a, b, sa, sb, alpha, out, config, _num_sms(out.device), pdl)
