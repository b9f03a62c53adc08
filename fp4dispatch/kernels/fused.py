"""Host side of the fused NVFP4 x NVFP4 Triton kernels: launch wrappers and the per-problem config lists.

Three kernels (``_fused.py``): ``gemv2`` (CUDA-core GEMV over int64 words = whole 16-blocks, any M in MB-row tiles;
with ``H2`` the products are fp16x2 FMAs; the M <= 4 pick), ``gemv`` (the older byte-wise GEMV, M <= MB; still wins
on some small shapes) and ``mma`` (bf16 tensor-core tiles, any M). All take canonical operands (uint8 [rows, K/2],
128x4-swizzled e4m3 scales) and support split-K through an fp32 workspace plus a finalize pass. A config is a
JSON-able dict; ``configs_for`` keeps the list short per M so that tuning one key costs well under a few seconds on a
GPU.
"""
from __future__ import annotations

import functools

import torch

from . import interpreting

__all__ = ["fused_mm", "configs_for", "DEFAULT_WARPS"]

DEFAULT_WARPS = 4
_SMS: dict[int, int] = {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _split_for(ctas: int, kb: int, bkb: int, sms: int) -> int:
    """Split-K factor that brings the grid to >= ~2 waves, keeping >= 4 K-steps per split."""
    if ctas >= 2 * sms:
        return 1
    want = _cdiv(2 * sms, max(ctas, 1))
    return max(1, min(want, kb // (4 * bkb)))


@functools.cache
def _interpreted() -> bool:
    # Triton fixes interpret-or-compile when the @triton.jit functions are defined, so the environment is read once
    # here instead of on every call (fused_mm runs per layer, per token)
    return interpreting()


def _launch_extras(config: dict) -> dict:
    # maxnreg caps registers per thread (more resident warps); the interpreter has no such launch option
    return {"maxnreg": int(config["maxnreg"])} if "maxnreg" in config and not _interpreted() else {}


def _has_fp8_cvt(device: torch.device) -> bool:
    """cvt.rn.f16x2.e4m3x2 exists on SM89+ (Ada, Hopper, Blackwell); not on Ampere, not in the interpreter."""
    if device.type != "cuda" or _interpreted():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (8, 9)


def configs_for(m: int, n: int, k: int, device: torch.device) -> list[dict]:
    """Candidate configs for one problem, best guess first (the first is also the untuned default)."""
    kb = k // 16
    sms = _num_sms(device)
    out: list[dict] = []

    def gemv(mb: int, bn: int, bkb: int, warps: int = 4) -> None:
        split = _split_for(_cdiv(n, bn), kb, bkb, sms)
        out.append({"kernel": "gemv", "MB": mb, "BN": bn, "BKB": bkb, "split": split, "warps": warps})

    def mma(bm: int, bn: int, bkb: int, warps: int, stages: int, split: int | None = None) -> None:
        if split is None:
            split = _split_for(_cdiv(m, bm) * _cdiv(n, bn), kb, bkb, sms)
        out.append({"kernel": "mma", "BM": bm, "BN": bn, "BKB": bkb, "split": split, "warps": warps,
                    "stages": stages})

    def gemv2(mb: int, bn: int, bkb: int, warps: int, warps_per_sm: int = 32, split: int | None = None,
              **extra) -> None:
        # CUDA-core GEMV time is latency-bound until ~32 resident warps per SM (H200 sweep, notes_hopper.md): split K
        # until the grid has that many warps, keeping >= 2 K steps per split
        if split is None:
            ctas = _cdiv(n, bn) * _cdiv(m, mb)
            split = max(1, min(_cdiv(warps_per_sm * sms, ctas * warps), kb // (2 * bkb)))
        cfg = {"kernel": "gemv2", "MB": mb, "BN": bn, "BKB": bkb, "split": split, "warps": warps, "stages": 3,
               "PAIR": True, **extra}
        if cfg not in out:
            out.append(cfg)

    # Picked from H200 sweeps (benchmarks/notes_hopper.md): at M <= 4 the fp16x2 GEMV (gemv2 with H2) in one launch
    # (split 1, small N tiles, the whole K per CTA); bf16 tensor-core tiles of 16 rows up to M = 16; from M ~ 128
    # on, triton:dequant+matmul (cuBLAS) wins. maxnreg/prefetch: the sweep's best register cap / register double
    # buffering.
    h2 = {"H2": True}
    # CVT decodes through the e4m3x2 -> f16x2 conversion instruction (SM89+): 2-5 % faster on the H200
    cvt = [{"CVT": True}] if _has_fp8_cvt(device) else []
    if m <= 2:
        gemv2(m, 4, 256, 4, split=1, maxnreg=64, **h2)
        gemv2(m, 4, 128, 2, split=1, prefetch=True, **h2)
        for extra in cvt:
            gemv2(m, 4, 128, 2, split=1, prefetch=True, **h2, **extra)
        gemv2(m, 16, 64, 4, split=1, prefetch=True, **h2)
        gemv2(m, 4, 128, 4, **h2)  # split-K sized for occupancy: short K or few N tiles
        gemv(m, 16, 32, warps=8)
        mma(16, 64, 8, 4, 3)
    elif m <= 4:
        gemv2(4, 16, 32, 4, split=1, prefetch=True, **h2)
        for extra in cvt:
            gemv2(4, 16, 32, 4, split=1, prefetch=True, **h2, **extra)
        gemv2(4, 8, 32, 2, split=1, prefetch=True, **h2)
        gemv2(4, 16, 32, 4, **h2)
        mma(16, 64, 8, 4, 3)
        mma(16, 64, 8, 4, 3, split=4)
    elif m <= 16:
        mma(16, 64, 8, 4, 3)
        mma(16, 64, 8, 4, 3, split=4)
        mma(16, 128, 8, 4, 3)
    elif m <= 64:
        mma(32 if m <= 32 else 64, 64, 8, 4, 3)
        mma(64, 128, 4, 4, 3)
    elif m <= 512:
        mma(128, 64, 8, 4, 3)
        mma(64, 128, 4, 4, 3)
    else:
        mma(128, 256, 4, 8, 3, split=1)
    return out


def fused_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
             out: torch.Tensor, config: dict) -> torch.Tensor:
    """``out = alpha * dequant(a) @ dequant(b).T`` with one Triton kernel (plus a finalize pass when split-K > 1).

    Args: canonical operands (see ``problem.Operands``); ``config`` from :func:`configs_for`.
    """
    if config.get("kernel") not in ("gemv", "gemv2", "mma"):
        raise ValueError(f"fused_mm: config['kernel'] must be 'gemv', 'gemv2' or 'mma'; got "
                         f"{config.get('kernel')!r}. Use a config from configs_for()")
    from . import _fused as kf

    m, k2 = a.shape
    n = b.shape[0]
    kb = k2 // 8
    cb = _cdiv(kb, 4)
    bkb = int(config["BKB"])
    split = max(1, int(config.get("split", 1)))
    per = _cdiv(_cdiv(kb, split), bkb) * bkb  # K blocks per split, a whole number of K steps
    split = _cdiv(kb, per)
    sa = a_scale.view(torch.uint8)
    sb = b_scale.view(torch.uint8)
    dst = out if split == 1 else torch.zeros((m, n), dtype=torch.float32, device=out.device)
    warps = int(config.get("warps", DEFAULT_WARPS))
    if config["kernel"] == "gemv2":
        bn, mb = int(config["BN"]), int(config["MB"])
        if bkb % 4:
            raise ValueError(f"fused_mm: gemv2 needs BKB % 4 == 0 (whole swizzled scale groups); got {bkb}")
        grid = (_cdiv(n, bn), split, _cdiv(m, mb))
        # int64 views: one word = one 16-block (K % 16 == 0); a misaligned view raises here, so the tuner skips it
        kf.gemv2_kernel[grid](a.view(torch.int64), b.view(torch.int64), sa, sb, alpha, dst, m, n, kb, cb, per,
                              MB=mb, BN=bn, BKB=bkb, PAIR=bool(config.get("PAIR", True)), ATOMIC=split > 1,
                              H2=bool(config.get("H2", False)), ASM=not _interpreted(), EVEN_K=kb % bkb == 0,
                              PREFETCH=bool(config.get("prefetch", False)), CVT=bool(config.get("CVT", False)),
                              num_warps=warps, num_stages=int(config.get("stages", 3)), **_launch_extras(config))
    elif config["kernel"] == "gemv":
        bn = int(config["BN"])
        grid = (_cdiv(n, bn), split)
        kf.gemv_kernel[grid](a, b, sa, sb, alpha, dst, m, n, k2, kb, cb, per, MB=int(config["MB"]), BN=bn,
                             BKB=bkb, ATOMIC=split > 1, num_warps=warps)
    else:
        bm, bn = int(config["BM"]), int(config["BN"])
        grid = (_cdiv(m, bm) * _cdiv(n, bn), split)
        kf.mma_kernel[grid](a, b, sa, sb, alpha, dst, m, n, k2, kb, cb, per, BM=bm, BN=bn, BKB=bkb,
                            GROUP_M=int(config.get("GROUP_M", 8)), ATOMIC=split > 1, DOT_F32=_interpreted(),
                            num_warps=warps, num_stages=int(config.get("stages", 3)))
    if split > 1:
        numel = m * n
        kf.finalize_kernel[(_cdiv(numel, 1024),)](dst, alpha, out, numel, BLOCK=1024)
    return out
