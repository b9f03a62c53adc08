"""Host side of the fused NVFP4 x NVFP4 Triton kernels: launch wrappers and the per-problem config lists (the Gluon
kernels' launches: ``gluon_host.py``).

Seven kernels: ``gemv2`` (``_fused.py``: CUDA-core GEMV over int64 words = whole 16-blocks, any M in MB-row tiles;
with ``H2`` the products are fp16x2 FMAs; the M <= 2 pick before SM90 and on the H200's small shapes), ``gvws``
(``_gvws.py``: the same products in a warp-specialized Gluon GEMV fed by TMA, SM90 with Triton 3.6, M <= 2; the
H200's pick at M <= 2 on the large shapes), ``wmma`` (``_wmma.py``: tensor-core tiles with the weight as the register
operand, SM89+; the pick from M = 3 to ~M = 512 on the H200; ``APRE`` decodes A once in a small kernel first; nibbles
go through the e4m3x2 -> f16x2 conversion), ``gemv`` (the older byte-wise GEMV, M <= MB), ``mma`` (bf16 tensor-core
tiles, any M; the fallback before SM89), ``wgws`` (``_gluon.py``: ``wmma``'s tiles as a warp-specialized Gluon
kernel, TMA loads by a producer warp; SM90 with Triton 3.6, M > 128; the pick from M = 1024; plain, persistent or with
the operands' roles swapped) and ``wgds`` (``_wgds.py``: the weight decoded by warps of their own into shared memory,
one warpgroup issuing the wgmma; SM90 with Triton 3.6, 64 < M <= 128). All take canonical operands (uint8
[rows, K/2], 128x4-swizzled e4m3 scales); all but ``wgws`` and ``gvws`` support split-K in the same launch (the last
CTA of a tile sums the fp32 partials: ``splitk.py``); ``wmma`` also as stream-K (``stream``: one wave of CTAs, each
the same share of all tiles' K steps). A config is a JSON-able dict; ``configs_for`` keeps the list short per M so
that tuning one key costs well under a few seconds on a GPU.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import cuda_index, jit_interpreted, splitk
from .launch import launch

__all__ = ["fused_mm", "configs_for", "DEFAULT_WARPS"]

log = logging.getLogger("fp4dispatch")

DEFAULT_WARPS = 4
MAX_CONFIGS = 7  # candidates per problem: tuning one key stays well under a few seconds on a GPU
_SMS: dict[int, int] = {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = cuda_index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _split_for(ctas: int, kb: int, bkb: int, sms: int) -> int:
    """Split-K factor that brings the grid to >= ~2 waves, keeping >= 4 K-steps per split."""
    if ctas >= 2 * sms:
        return 1
    want = _cdiv(2 * sms, max(ctas, 1))
    return max(1, min(want, kb // (4 * bkb)))


_interpreted = jit_interpreted  # a module attribute, so that tests can patch it


def _launch_extras(config: dict) -> dict:
    # maxnreg caps registers per thread (more resident warps); the interpreter has no such launch option
    return {"maxnreg": int(config["maxnreg"])} if "maxnreg" in config and not _interpreted() else {}


@functools.cache
def _pdl_capable(idx: int) -> bool:
    from ._fused import HAS_GDC

    return HAS_GDC and torch.cuda.get_device_capability(idx) >= (9, 0)


def _pdl(device: torch.device, config: dict) -> dict:
    """Launch option for programmatic dependent launch (SM90+): the kernel is launched while the previous one on the
    stream finishes and waits for its writes in ``pdl_wait`` (H200: 0.1-0.4 us less per launch in a graph).
    ``config["pdl"]`` False turns it off (benchmarks compare both)."""
    if not config.get("pdl", True) or device.type != "cuda" or _interpreted():
        return {}
    return {"launch_pdl": True, "PDL": True} if _pdl_capable(cuda_index(device)) else {}


def _has_fp8_cvt(device: torch.device) -> bool:
    """cvt.rn.f16x2.e4m3x2 exists on SM89+ (Ada, Hopper, Blackwell); not on Ampere, not in the interpreter."""
    if device.type != "cuda" or _interpreted():
        return False
    return torch.cuda.get_device_capability(cuda_index(device)) >= (8, 9)


# wmma tiles (BM, BN, BKB, warps, stages, split[, APRE]) by M bound, best first (H200 sweeps, notes_hopper.md).
# APRE (A decoded once by a small kernel first) won every same-tile pair on the large shapes; the last M <= 16 tile
# decodes A in its loop instead, which saves that launch where the whole GEMM lasts a few microseconds.
_WMMA_TILES = {
    16: [(16, 64, 16, 4, 3, 4), (16, 128, 16, 8, 3, 4), (16, 64, 16, 4, 3, 2), (16, 64, 16, 4, 3, 4, False)],
    32: [(32, 128, 8, 8, 4, 2), (32, 64, 16, 4, 3, 4)],
    64: [(64, 128, 8, 8, 4, 2), (64, 64, 16, 4, 3, 4)],
    512: [(128, 128, 8, 8, 3, 2), (128, 128, 8, 8, 4, 4), (64, 128, 8, 8, 4, 2)],
    1 << 62: [(256, 128, 8, 8, 3, 1), (128, 256, 4, 8, 3, 1)],
}


def _wmma_resident(bm: int, warps: int) -> int:
    """CTAs of a ``wmma`` tile resident per H200 SM (ncu): 4-warp tiles of BM <= 64 hold 4 (122-127 registers,
    ~51 KB of shared memory); 8-warp tiles 2; BM >= 128 one (117 KB of shared memory)."""
    return 1 if bm >= 128 else max(1, 16 // warps)


@functools.lru_cache(maxsize=256)
def _stream_parts(tiles: int, steps: int, ctas: int) -> int:
    """Most CTAs that share one tile under ``wmma_sk_kernel``'s cut (CTA c starts at step c * total // ctas): the
    depth of the split-K workspace."""
    total = tiles * steps
    return max(((t + 1) * steps * ctas - 1) // total - ((t * steps + 1) * ctas - 1) // total + 1 for t in range(tiles))


def _wmma_rank(device: torch.device) -> int:
    """0: no ``wmma`` (its scale decode needs cvt.rn.f16x2.e4m3x2, SM89+); 1: offered after the older kernels;
    2: offered first (SM90: the weight stays in registers as the wgmma operand). The interpreter offers it (CI)."""
    if device.type != "cuda":
        return 1 if _interpreted() else 0
    if _interpreted():
        return 0
    cap = torch.cuda.get_device_capability(cuda_index(device))
    return 2 if cap[0] == 9 else 1 if cap >= (8, 9) else 0


def _gluon_ok(device: torch.device) -> bool:
    """The Gluon kernels (``wgws``, ``wgds``, ``gvws``) need SM90 itself (wgmma, TMA, setmaxnreg: sm_90a; Blackwell
    has none of them), compiled kernels (``_wmma_rank`` 2 says both) and a Triton whose Gluon has what they use."""
    from . import gluon_missing

    if _wmma_rank(device) != 2:
        return False
    why = gluon_missing()
    if why:
        log.debug("fp4dispatch: no wgws/wgds/gvws configs: %s", why)
    return why is None


# wgws tiles (BM, BN, BKB, stages) for M > 128 (H200, benchmarks/RESULTS.md eighth and ninth sessions): BM 256 from
# M = 257 (0.89-0.99x cuBLAS bf16 at M = 1024 on the large shapes across runs; with BN 64, one consumer warpgroup and
# twice the N tiles, 11-20 % faster where BN 128 leaves the SMs under two waves), BM 128 up to M = 512; the largest
# rings that fit 227 KB of shared memory. From M = 257 the first tile is also offered persistent (one CTA per SM, the
# loads run on across tile ends) and, where M > N, swapped (the weight is the operand decoded first, so fewer values
# are: 2048x6144 and 768x6144 at M = 4096 156.6 -> 145.9 us and 90.6 -> 75.5 us, ninth session run 3); the BN 64 tile
# swapped as well (768x6144 at M = 8192: 122.9 us against 142.1 for BN 128 swapped, fifteenth session run 1).
_WGWS_TILES = ((256, 128, 4, 5), (256, 64, 8, 3), (128, 128, 8, 4))


# gvws tiles (R, BW, stages, CTAs per SM) for M <= 2, 4 consumer warps (H200, benchmarks/RESULTS.md tenth session):
# the two best of the sweep on the large shapes, 6-12 % faster than gemv2 at M = 1 and 17-22 % at M = 2; gemv2 stays
# faster on the small shapes (run 6; not profiled), which the tuner sees. Offered with DP, the int8 dot products
# (_dp4.py): 18 % fewer loop instructions, faster than the fp16 pairs in every cell measured (eleventh session runs 8
# and 17: 3-4 % at M = 1, 8-12 % at M = 2 on the large shapes).
_GVWS_TILES = ((16, 32, 5, 2), (8, 32, 6, 3))


# wgds (_wgds.py: the decode in warps of its own, both wgmma operands in shared memory) for 64 < M <= 128: BN 64,
# BM 128, BKB 8, rings of 4 (weight), 4 (activation) and 3 (decoded) slots, 2 decode partitions; plain and
# persistent. H200, M = 128: 42.1 / 138.8 / 124.0 us against wmma's 47.4 / 134.5 / 130.1 on the large shapes, 17.9
# against 23.5 on 6144x2048 (twelfth session); on 2048x6144 slower whole, faster in K parts (_wgds_split; the tuner
# chooses). A third decoded slot: 0-5 % faster, no shape slower (thirteenth session run 1: 41.6 / 139.7 / 120.3
# against 42.2 / 146.5 / 125.4); an activation ring of 2 or 3 slots to make room for deeper ones was slower.
_WGDS = {"kernel": "wgds", "BM": 128, "BN": 64, "BKB": 8, "stages": 4, "astages": 4, "dstages": 3, "parts": 2}


def wgds_work(m: int, n: int, kb: int, bm: int, bn: int, bkb: int) -> tuple[int, int, int]:
    """(N tiles, tiles, K steps per tile) of ``wgds`` over out [m, n] and kb 16-blocks: a tile takes BN / 4 rows of
    each 32-row quarter of a 128-row group (``_wgds._tile_rows``), so each group makes 128 / BN N tiles."""
    nt = _cdiv(n, 128) * (128 // bn)
    return nt, nt * _cdiv(m, bm), _cdiv(kb, bkb)


def _wgds_split(tiles: int, steps: int, sms: int) -> int:
    """K parts per wgds tile where its tiles leave SMs idle (N <= 2048 at M = 128 on 132 SMs): the number that
    minimizes the busiest SM's K steps plus the partial sums' cost, ceil(steps / s) + 6 + 3 s (H200, thirteenth
    session: ~3 us + ~1.45 us per part at ~0.49 us per K step; with the sums read 16 bytes and four parts at a time,
    fourteenth session run 7, 2048x6144 in 2 / 3 / 4 / 6 / 8 parts took 23.1 / 20.4 / 19.7 / 26.5 / 29.9 us and
    768x6144 22.6 / 19.4 / 18.1 / 17.9 / 17.8: the same picks, within 0.3 us of the best), with every part on an SM
    of its own (a second wave of parts measured far slower: 6144x2048 in 4 parts 41.6 us against 17.9 whole) and
    >= 2 steps each."""
    return min(range(1, max(1, min(16, steps // 2, sms // tiles)) + 1),
               key=lambda s: _cdiv(steps, s) + (6 + 3 * s if s > 1 else 0))


def _wgws_configs(m: int, n: int) -> list[dict]:
    """The wgws candidates for M > 128, best guess first."""
    plain = [{"kernel": "wgws", "BM": bm, "BN": bn, "BKB": bkb, "stages": st} for bm, bn, bkb, st in _WGWS_TILES
             if (bm == 256 and m > 256) or (bm == 128 and m <= 512)]
    if m <= 256:
        return plain
    out = [dict(plain[0], persist=True)] + plain
    if m > n:  # both BM 256 tiles swapped, the BN 128 one first
        swaps = [dict(t, swap=True) for t in plain if t["BM"] == 256]
        out = swaps[:1] + out + swaps[1:]
    return out


def configs_for(m: int, n: int, k: int, device: torch.device) -> list[dict]:
    """Candidate configs for one problem (at most ``MAX_CONFIGS``), best guess first (the first is also the untuned
    default)."""
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

    def wmma(bm: int, bn: int, bkb: int, warps: int, stages: int, split: int, apre: bool = True) -> dict:
        tiles = _cdiv(n, bn) * _cdiv(m, bm)
        if tiles * split < sms:  # under one wave (small N): split K until the SMs hold as many CTAs as they can
            split = max(split, sms * _wmma_resident(bm, warps) // tiles)
        split = max(1, min(split, kb // (2 * bkb)))  # keep >= 2 K steps per split
        return {"kernel": "wmma", "BM": bm, "BN": bn, "BKB": bkb, "split": split, "warps": warps, "stages": stages,
                **({"APRE": True} if apre else {})}

    # Picked from H200 sweeps (benchmarks/notes_hopper.md): at M <= 2 on SM90 the TMA-fed Gluon GEMV (gvws), then the
    # fp16x2 GEMV (gemv2 with H2) in one launch (split 1, small N tiles, the whole K per CTA); above, the
    # swapped-operand tensor-core wmma (first on SM90; the older bf16 mma stays as the fallback); from M ~ 1024 on,
    # wgws (SM90), except on the smallest shape (768x6144 at M = 1024) and 28672x8192 at M = 8192, where
    # triton:dequant+matmul (cuBLAS) wins. gemv2 keeps the small shapes at M <= 2 (tenth session's table).
    # maxnreg/prefetch: the sweep's best register cap / register double buffering.
    rank = _wmma_rank(device)
    h2 = {"H2": True}
    # CVT decodes through the e4m3x2 -> f16x2 conversion instruction (SM89+): 2-5 % faster on the H200
    cvt = [{"CVT": True}] if _has_fp8_cvt(device) else []
    if m <= 2:
        if n % 32 == 0 and k % 32 == 0 and _gluon_ok(device):  # SM90: the TMA-fed GEMV first (its boxes: see _gvws)
            out += [{"kernel": "gvws", "MB": m, "R": r, "BW": bw, "stages": st, "warps": 4, "ctas": c, "DP": True}
                    for r, bw, st, c in _GVWS_TILES]
        gemv2(m, 4, 256, 4, split=1, maxnreg=64, **h2)
        gemv2(m, 4, 128, 2, split=1, prefetch=True, **h2)
        for extra in cvt:
            gemv2(m, 4, 128, 2, split=1, prefetch=True, **h2, **extra)
        gemv2(m, 16, 64, 4, split=1, prefetch=True, **h2)
        gemv2(m, 4, 128, 4, **h2)  # split-K sized for occupancy: short K or few N tiles
        if rank:
            out.append(wmma(*_WMMA_TILES[16][0]))
        else:
            gemv(m, 16, 32, warps=8)
            mma(16, 64, 8, 4, 3)
        return out[:MAX_CONFIGS]
    if m <= 4:
        gemv2(4, 16, 32, 4, split=1, prefetch=True, **h2)
        for extra in cvt:
            gemv2(4, 16, 32, 4, split=1, prefetch=True, **h2, **extra)
        gemv2(4, 8, 32, 2, split=1, prefetch=True, **h2)
        mma(16, 64, 8, 4, 3, split=4)
    elif m <= 16:
        mma(16, 64, 8, 4, 3)
        mma(16, 64, 8, 4, 3, split=4)
    elif m <= 64:
        mma(32 if m <= 32 else 64, 64, 8, 4, 3)
        mma(64, 128, 4, 4, 3)
    elif m <= 512:
        mma(128, 64, 8, 4, 3)
        mma(64, 128, 4, 4, 3)
    else:
        mma(128, 256, 4, 8, 3, split=1)
    if rank:
        bound = min(b for b in _WMMA_TILES if m <= b)  # the last bound, 2**62, holds every M
        new = []
        for t in _WMMA_TILES[bound]:
            cfg = wmma(*t)
            if cfg not in new:  # small shapes: tiles that differ only by split may get the same sized split
                new.append(cfg)
        if m > 16:  # stream-K of the first tile: no partial last wave whatever the tile count
            new.append(dict(new[0], split=1, stream=True))
        if rank == 2:  # SM90: wmma beat the older bf16 mma at every M of the H200 sweeps
            out = new + [c for c in out if c["kernel"] != "mma"]
        else:
            out += new[:max(1, MAX_CONFIGS - len(out))]
    # SM90, M > 128: the warp-specialized Gluon kernel first (its TMA needs 16-byte weight rows: K % 32 == 0); from
    # M = 65, wgds after the first wmma tile (N % 32 == 0: its boxes take rows the way the scales are stored)
    if m > 128 and k % 32 == 0 and _gluon_ok(device):
        out = (_wgws_configs(m, n) + out)[:MAX_CONFIGS]
    elif m > 64 and n % 32 == 0 and k % 32 == 0 and _gluon_ok(device):
        _, tiles, steps = wgds_work(m, n, kb, _WGDS["BM"], _WGDS["BN"], _WGDS["BKB"])
        split = _wgds_split(tiles, steps, sms)
        wgds = [dict(_WGDS, split=split)] if split > 1 else []
        out = (out[:1] + wgds + [_WGDS, dict(_WGDS, persist=True)] + out[1:])[:MAX_CONFIGS]
    return out


def _split_args(parts: int, tiles: int, m: int, n: int, out: torch.Tensor) -> tuple:
    """(workspace, counters) for tiles summed from up to ``parts`` partials; ``out`` twice when none is (unused)."""
    if parts == 1:
        return out, out
    return splitk.buffers(m, n, parts, tiles, out.device)


def gluon_pdl(pdl: dict) -> tuple[dict, dict]:
    """(pre-decode options, launch options) of a Gluon kernel that runs after ``predecode`` (``wgws``, ``wgds``)
    with PDL (``pdl``: :func:`_pdl`'s): the pre-decode lets the kernel launch as soon as the kernels before it are
    done (EARLY), and the kernel waits for the pre-decode only where it loads the decoded operand."""
    return ({**pdl, "EARLY": True}, {"launch_pdl": True}) if pdl else ({}, {})


def wgds_split_args(parts: int, tiles: int, block: int, alpha: torch.Tensor, out: torch.Tensor) -> tuple:
    """(workspace, counters) of ``wgds``'s split K (``_wgds.split_epilogue``: a ``block``-element fp32 block per
    (tile, part)). Typed as for a split launch even when ``parts`` is 1: SPLIT is a runtime value
    (``do_not_specialize``), so the split epilogue is compiled whatever it is, and its atomics need int32 counters;
    the 1-element alpha stands in for both, never read or written."""
    if parts == 1:
        return alpha, alpha.view(torch.int32)
    return splitk.buffers(tiles, block, parts, tiles, out.device)


def predecode(a64: torch.Tensor, sa: torch.Tensor, asm: bool, tile: tuple = (16, 16, 4), **opts) -> torch.Tensor:
    """``wmma``'s APRE step, also ``wgws``'s: one operand (int64 words [m, kb], swizzled scale bytes ``sa``; A, or the
    weight in a swapped ``wgws``) decoded once into [m, ceil(kb/4)*64] in wmma's K order, fp16 (fp32 in the
    interpreter, ``asm`` False); ``tile``: (rows, 16-blocks, warps) per CTA; ``opts``: the PDL and CVT launch
    options."""
    from . import _wmma

    (m, kb), (br, bkb, warps) = a64.shape, tile
    if bkb % 4:  # the scale swizzle and wmma's K order both go by groups of 4 blocks
        raise ValueError(f"predecode: tile[1] (16-blocks per CTA) must be a multiple of 4; got tile={tile}")
    ad = torch.empty((m, _cdiv(kb, 4) * 64), dtype=torch.float16 if asm else torch.float32, device=a64.device)
    launch(_wmma.wmma_prep_a_kernel, (_cdiv(m, br), _cdiv(kb, bkb)), a64, sa, ad, m, kb, _cdiv(kb, 4), BR=br, BKB=bkb,
           ASM=asm, num_warps=warps, **opts)
    return ad


def fused_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
             out: torch.Tensor, config: dict) -> torch.Tensor:
    """``out = alpha * dequant(a) @ dequant(b).T`` with one Triton or Gluon kernel (``wmma`` with APRE, ``wgws`` and
    ``wgds``: two, the first decoding one operand).

    Args: canonical operands (see ``problem.Operands``); ``config`` from :func:`configs_for`.
    """
    if config.get("kernel") not in ("gemv", "gemv2", "mma", "wmma", "wgws", "wgds", "gvws"):
        raise ValueError(f"fused_mm: config['kernel'] must be 'gemv', 'gemv2', 'mma', 'wmma', 'wgws', 'wgds' or "
                         f"'gvws'; got {config.get('kernel')!r}. Use a config from configs_for()")
    if config["kernel"] == "gvws":
        from .gluon_host import run_gvws

        run_gvws(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), alpha, out, config)
        return out
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
    warps = int(config.get("warps", DEFAULT_WARPS))
    pdl = _pdl(out.device, config)
    if config["kernel"] in ("gemv2", "wmma", "wgws", "wgds") and bkb % 4:
        raise ValueError(f"fused_mm: {config['kernel']} needs BKB % 4 == 0 (whole swizzled scale groups); got {bkb}")
    if config["kernel"] == "wgws":
        from .gluon_host import run_wgws

        run_wgws(a, b, sa, sb, alpha, out, config, pdl)
    elif config["kernel"] == "wgds":
        from .gluon_host import run_wgds

        run_wgds(a, b, sa, sb, alpha, out, config, pdl)
    elif config["kernel"] == "wmma":
        from . import _wmma

        bn, bm = int(config["BN"]), int(config["BM"])
        asm, a64 = not _interpreted(), a.view(torch.int64)
        # CVT (default): nibbles through e4m3 bytes and cvt.rn.f16x2.e4m3x2, 2-25 % faster on the H200 than the bit
        # placement ("CVT": False, kept for A/B runs); the interpreter forms the same values in fp32 either way
        cvt = {"CVT": True} if asm and config.get("CVT", True) else {}
        if config.get("APRE"):
            a64 = predecode(a64, sa, asm, **pdl, **cvt)
        opts = dict(BM=bm, BN=bn, BKB=bkb, ASM=asm, APRE=bool(config.get("APRE")), num_warps=warps,
                    num_stages=int(config.get("stages", 3)), **_launch_extras(config), **pdl, **cvt)
        if config.get("stream"):  # stream-K: one wave of CTAs, each the same number of K steps
            nt, steps = _cdiv(n, bn), _cdiv(kb, bkb)
            tiles = nt * _cdiv(m, bm)
            ctas = min(tiles * steps, int(config.get("ctas") or _num_sms(out.device) * _wmma_resident(bm, warps)))
            launch(_wmma.wmma_sk_kernel, (ctas,), a64, b.view(torch.int64), sa, sb, alpha, out,
                   *_split_args(_stream_parts(tiles, steps, ctas), tiles, m, n, out), m, n, kb, cb, nt, tiles, steps,
                   **opts)
        else:
            grid = (_cdiv(n, bn), split, _cdiv(m, bm))
            launch(_wmma.wmma_kernel, grid, a64, b.view(torch.int64), sa, sb, alpha, out,
                   *_split_args(split, grid[0] * grid[2], m, n, out), m, n, kb, cb, per, SPLIT=split > 1, **opts)
    elif config["kernel"] == "gemv2":
        bn, mb = int(config["BN"]), int(config["MB"])
        grid = (_cdiv(n, bn), split, _cdiv(m, mb))
        # int64 views: one word = one 16-block (K % 16 == 0); a misaligned view raises here, so the tuner skips it
        launch(kf.gemv2_kernel, grid, a.view(torch.int64), b.view(torch.int64), sa, sb, alpha, out,
               *_split_args(split, grid[0] * grid[2], m, n, out), m, n, kb, cb, per,
               MB=mb, BN=bn, BKB=bkb, PAIR=bool(config.get("PAIR", True)), SPLIT=split > 1,
               H2=bool(config.get("H2", False)), ASM=not _interpreted(), EVEN_K=kb % bkb == 0,
               PREFETCH=bool(config.get("prefetch", False)), CVT=bool(config.get("CVT", False)),
               num_warps=warps, num_stages=int(config.get("stages", 3)), **_launch_extras(config), **pdl)
    elif config["kernel"] == "gemv":
        bn = int(config["BN"])
        grid = (_cdiv(n, bn), split)
        launch(kf.gemv_kernel, grid, a, b, sa, sb, alpha, out, *_split_args(split, grid[0], m, n, out), m, n, k2, kb,
               cb, per, MB=int(config["MB"]), BN=bn, BKB=bkb, SPLIT=split > 1, num_warps=warps)
    else:
        bm, bn = int(config["BM"]), int(config["BN"])
        grid = (_cdiv(m, bm) * _cdiv(n, bn), split)
        launch(kf.mma_kernel, grid, a, b, sa, sb, alpha, out, *_split_args(split, grid[0], m, n, out), m, n, k2, kb,
               cb, per, BM=bm, BN=bn, BKB=bkb, GROUP_M=int(config.get("GROUP_M", 8)), SPLIT=split > 1,
               DOT_F32=_interpreted(), num_warps=warps, num_stages=int(config.get("stages", 3)))
    return out
