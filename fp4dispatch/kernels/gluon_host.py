"""Host side of the Gluon kernels (SM90 with Triton 3.6): the checks their TMA boxes and rings need, then the launch.
``wgws`` (``_gluon.py``), ``gvws`` (``_gvws.py``) and ``wgds`` (``_wgds.py``); the kernel modules import Gluon, so
they are imported here only when a config of theirs runs (``fused.fused_mm``). Which configs are offered, and where:
``fused.configs_for``.
"""
from __future__ import annotations

import torch

from .fused import _cdiv, _num_sms, gluon_pdl, predecode
from . import splitk
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
    from . import _gluon

    indec = bool(config.get("indec"))
    if indec:  # the kernel decodes y itself (_gluon._ydecode) into this buffer, with the grid's sync state
        yd = torch.empty((ny, cb * 64), dtype=torch.float16, device=out.device)
        sync = splitk.counters(2 + _cdiv(kb, _gluon._DKB.value), out.device)
        opts = {"launch_pdl": True} if pdl else {}
        dec = (y.view(torch.int64), sy, yd, sync)
    else:
        pre, opts = gluon_pdl(pdl)  # with PDL only wgws's producer waits for the pre-decode
        yd = predecode(y.view(torch.int64), sy, True, CVT=True, **pre)
        dec = (alpha, alpha, alpha, alpha.view(torch.int32))  # typed stand-ins, never read

    bm, bn, bkb, stages = (int(config[key]) for key in ("BM", "BN", "BKB", "stages"))
    x_layout, y_layout = _gluon.layouts(bn, bm, bkb)
    x_desc = tma_desc(x.data_ptr(), torch.int64, (nx, kb), (kb, 1), (bn, bkb), x_layout)
    y_desc = tma_desc(yd.data_ptr(), yd.dtype, tuple(yd.shape), yd.stride(), (bm, bkb * 16), y_layout)
    nt, steps = _cdiv(nx, bn), _cdiv(kb, bkb)
    tiles = nt * _cdiv(ny, bm)
    # persist: one CTA per SM (the ring fills its shared memory), whole tiles each, so that the loads run on across
    # a tile's epilogue; else one CTA per tile
    ctas = min(tiles, _num_sms(out.device)) if config.get("persist") else tiles
    launch(_gluon.wgws_kernel, (ctas,), x_desc, y_desc, sx, alpha, out, ny, nx, kb, cb, nt, tiles, steps, *dec,
           BN=bn, BM=bm, BKB=bkb, STAGES=stages, SWAP=swap, INDEC=indec, num_warps=bn // 16, **opts)

