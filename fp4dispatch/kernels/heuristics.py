"""Candidate configs of one problem, best guess first: named tile tables, one function per M range.

The first candidate is also the untuned default; the list stays at most ``MAX_CONFIGS`` long, so that tuning one key
costs well under a few seconds on a GPU. Which family wins where, and why the tiles are these, is in docs/kernels.md
(measured numbers: benchmarks/RESULTS.md). In short, on SM90: M <= 2 the TMA-fed GEMV, else the CUDA-core GEMV;
M <= 64 ``wgmma_register_a``; 64 < M <= 128 ``wgmma_decode_warps`` after the first ``wgmma_register_a`` tile;
M > 128 ``wgmma_warp_specialized`` first. Before SM89 the bf16 ``mma`` and the GEMVs; SM89 and SM12x add
``wgmma_register_a`` after them.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import runtime, target
from .config import (BytewiseGemvConfig, CudaCoreGemvConfig, CudaCoreW4A16Config, KernelConfig, MmaBf16Config,
                     MmaW4A16Config, TmaGemvConfig, TmaMmaW4A16Config, WgmmaDecodeWarpsConfig,
                     WgmmaDecodeWarpsW4A16Config, WgmmaRegisterAConfig, WgmmaRegisterAW4A16Config,
                     WgmmaWarpSpecializedConfig, WgmmaWarpSpecializedW4A16Config, decode_warps_work,
                     register_a_resident)
from .config_grouped import GemvGroupedConfig, MmaGroupedConfig, MmaW4A16GroupedConfig, TmaGemvGroupedConfig

__all__ = ["configs_for", "w4a16_configs_for", "grouped_configs_for", "w4a16_grouped_configs_for",
           "GROUPED_GEMV_TILES", "GROUPED_MMA_TILES",
           "MAX_CONFIGS", "REGISTER_A_TILES", "WARP_SPECIALIZED_TILES", "TMA_GEMV_TILES", "DECODE_WARPS",
           "W4A16_MMA_TILES", "W4A16_GEMV_TILES"]

MAX_CONFIGS = 7
cdiv = runtime.cdiv

# wgmma_register_a tiles (block_m, block_n, k_blocks, warps, stages, split_k[, predecode_a]) by the largest M they
# serve, best first. predecode_a (A decoded once by a small kernel) is the default; the last M <= 16 tile decodes A
# in its loop instead, which saves that launch where the whole GEMM is a few microseconds.
REGISTER_A_TILES = {
    16: [(16, 64, 16, 4, 3, 4), (16, 128, 16, 8, 3, 4), (16, 64, 16, 4, 3, 2), (16, 64, 16, 4, 3, 4, False)],
    32: [(32, 128, 8, 8, 4, 2), (32, 64, 16, 4, 3, 4)],
    64: [(64, 128, 8, 8, 4, 2), (64, 64, 16, 4, 3, 4)],
    512: [(128, 128, 8, 8, 3, 2), (128, 128, 8, 8, 4, 4), (64, 128, 8, 8, 4, 2)],
    1 << 62: [(256, 128, 8, 8, 3, 1), (128, 256, 4, 8, 3, 1)],
}

# wgmma_warp_specialized tiles (block_m, block_n, k_blocks, stages) for M > 128: block_m 256 from M = 257, 128 up to
# M = 512; block_n 64 doubles the N tiles where 128 leaves the SMs under two waves; each ring is the deepest that
# fits 227 KB of shared memory.
WARP_SPECIALIZED_TILES = ((256, 128, 4, 5), (256, 64, 8, 3), (128, 128, 8, 4))

# tma_warp_specialized tiles (rows_per_quarter, k_blocks, stages, ctas_per_sm) for M <= 2, 4 consumer warps, with the
# int8 dot products (fewer loop instructions than the fp16x2 pairs)
TMA_GEMV_TILES = ((16, 32, 5, 2), (8, 32, 6, 3))

# wgmma_decode_warps for 64 < M <= 128: block_n 64 (128 does not compile with two decode partitions), three decoded
# slots, the activation ring as deep as the weight's
DECODE_WARPS = WgmmaDecodeWarpsConfig(block_m=128, block_n=64, k_blocks=8, stages=4, act_stages=4, decoded_stages=3,
                                      decode_partitions=2)


class _Problem:
    """One problem on one device, with the builders of its candidates (each sizes its own K split)."""

    def __init__(self, m: int, n: int, k: int, device: torch.device):
        self.m, self.n, self.k, self.kb = m, n, k, k // 16
        self.device = device
        self.sms = runtime.num_sms(device)

    def split_for(self, ctas: int, k_blocks: int) -> int:
        """K parts that bring the grid to >= ~2 waves, keeping >= 4 K steps per part."""
        if ctas >= 2 * self.sms:
            return 1
        return max(1, min(cdiv(2 * self.sms, max(ctas, 1)), self.kb // (4 * k_blocks)))

    def bytewise_gemv(self, rows: int, block_n: int, k_blocks: int, warps: int = 4) -> BytewiseGemvConfig:
        return BytewiseGemvConfig(rows, block_n, k_blocks, self.split_for(cdiv(self.n, block_n), k_blocks), warps)

    def mma(self, block_m: int, block_n: int, k_blocks: int, warps: int, stages: int,
            split: int | None = None) -> MmaBf16Config:
        if split is None:
            split = self.split_for(cdiv(self.m, block_m) * cdiv(self.n, block_n), k_blocks)
        return MmaBf16Config(block_m, block_n, k_blocks, split, warps, stages)

    def cuda_core_gemv(self, rows: int, block_n: int, k_blocks: int, warps: int, split: int | None = None,
                       **switches) -> CudaCoreGemvConfig:
        # a CUDA-core GEMV is latency-bound until ~32 warps are resident per SM: without a given split, split K
        # until the grid has that many, keeping >= 2 K steps per part
        if split is None:
            ctas = cdiv(self.n, block_n) * cdiv(self.m, rows)
            split = max(1, min(cdiv(32 * self.sms, ctas * warps), self.kb // (2 * k_blocks)))
        return CudaCoreGemvConfig(rows, block_n, k_blocks, split, warps, **switches)

    def register_a(self, block_m: int, block_n: int, k_blocks: int, warps: int, stages: int, split: int,
                   predecode_a: bool = True) -> WgmmaRegisterAConfig:
        tiles = cdiv(self.n, block_n) * cdiv(self.m, block_m)
        if tiles * split < self.sms:  # under one wave (small N): split K until the SMs hold as many CTAs as fit
            split = max(split, self.sms * register_a_resident(block_m, warps) // tiles)
        split = max(1, min(split, self.kb // (2 * k_blocks)))  # keep >= 2 K steps per part
        return WgmmaRegisterAConfig(block_m, block_n, k_blocks, split, warps, stages, predecode_a=predecode_a)


def _add(out: list, cfg: KernelConfig) -> None:
    if cfg not in out:
        out.append(cfg)


def _gemv_m_le_2(p: _Problem, rank: int, convert: bool) -> list[KernelConfig]:
    """M <= 2: the TMA-fed GEMV first (SM90 with Gluon; its boxes need N % 32 == 0 and K % 32 == 0), then the
    CUDA-core GEMV in one launch (the whole K per CTA, small N tiles), one with the split sized for occupancy (short
    K or few N tiles), and the smallest tensor-core tile."""
    out: list[KernelConfig] = []
    if p.n % 32 == 0 and p.k % 32 == 0 and target.gluon_ok(p.device):
        out += [TmaGemvConfig(p.m, r, bw, st, warps=4, ctas_per_sm=c, int8_dot=True) for r, bw, st, c in TMA_GEMV_TILES]
    _add(out, p.cuda_core_gemv(p.m, 4, 256, 4, split=1, max_registers=64, fp16x2=True))
    _add(out, p.cuda_core_gemv(p.m, 4, 128, 2, split=1, prefetch=True, fp16x2=True))
    if convert:
        _add(out, p.cuda_core_gemv(p.m, 4, 128, 2, split=1, prefetch=True, fp16x2=True, e4m3x2_convert=True))
    _add(out, p.cuda_core_gemv(p.m, 16, 64, 4, split=1, prefetch=True, fp16x2=True))
    _add(out, p.cuda_core_gemv(p.m, 4, 128, 4, fp16x2=True))
    if rank:
        out.append(p.register_a(*REGISTER_A_TILES[16][0]))
    else:
        out.append(p.bytewise_gemv(p.m, 16, 32, warps=8))
        out.append(p.mma(16, 64, 8, 4, 3))
    return out[:MAX_CONFIGS]


def _older_kernels(p: _Problem, convert: bool) -> list[KernelConfig]:
    """M > 2: the CUDA-core GEMV (M <= 4) and the bf16 ``mma`` tiles, by M range."""
    m, out = p.m, []
    if m <= 4:
        _add(out, p.cuda_core_gemv(4, 16, 32, 4, split=1, prefetch=True, fp16x2=True))
        if convert:
            _add(out, p.cuda_core_gemv(4, 16, 32, 4, split=1, prefetch=True, fp16x2=True, e4m3x2_convert=True))
        _add(out, p.cuda_core_gemv(4, 8, 32, 2, split=1, prefetch=True, fp16x2=True))
        out.append(p.mma(16, 64, 8, 4, 3, split=4))
    elif m <= 16:
        out += [p.mma(16, 64, 8, 4, 3), p.mma(16, 64, 8, 4, 3, split=4)]
    elif m <= 64:
        out += [p.mma(32 if m <= 32 else 64, 64, 8, 4, 3), p.mma(64, 128, 4, 4, 3)]
    elif m <= 512:
        out += [p.mma(128, 64, 8, 4, 3), p.mma(64, 128, 4, 4, 3)]
    else:
        out.append(p.mma(128, 256, 4, 8, 3, split=1))
    return out


def _register_a(p: _Problem) -> list[WgmmaRegisterAConfig]:
    """The ``wgmma_register_a`` tiles of M's range (small shapes: tiles that differ only by split may get the same
    sized split, kept once); from M = 17 also the first one as stream-K, which leaves no partial last wave whatever
    the tile count, where a tile has more than one K step (with one, ``run`` launches the first one's kernel:
    wgmma_register_a.py, STEPS_NOTE)."""
    new: list[WgmmaRegisterAConfig] = []
    for tile in REGISTER_A_TILES[min(b for b in REGISTER_A_TILES if p.m <= b)]:
        _add(new, p.register_a(*tile))
    if p.m > 16 and cdiv(p.kb, new[0].k_blocks) > 1:
        new.append(replace(new[0], split_k=1, stream_k=True))
    return new


def _warp_specialized(m: int, n: int, kind: type[WgmmaWarpSpecializedConfig] = WgmmaWarpSpecializedConfig) -> list:
    """The ``wgmma_warp_specialized`` candidates for M > 128 as ``kind`` (its op's config class): from M = 257 the
    first tile also persistent (the loads run on across tile ends) and, where M > N and ``kind.swappable``, both
    block_m 256 tiles with the operands' roles swapped (the weight is then the operand decoded first, so fewer values
    are decoded), the block_n 128 one first."""
    plain = [kind(bm, bn, bkb, st) for bm, bn, bkb, st in WARP_SPECIALIZED_TILES
             if (bm == 256 and m > 256) or (bm == 128 and m <= 512)]
    if m <= 256:
        return plain
    out = [replace(plain[0], persistent=True)] + plain
    if m > n and kind.swappable:
        swaps = [replace(t, swap=True) for t in plain if t.block_m == 256]
        out = swaps[:1] + out + swaps[1:]
    return out


def decode_warps_split(tiles: int, steps: int, sms: int) -> int:
    """K parts per ``wgmma_decode_warps`` tile where its tiles leave SMs idle: the number that minimizes the busiest
    SM's K steps plus the partial sums' cost, modelled as ceil(steps / s) + 6 + 3 s K steps, with every part on an
    SM of its own (a second wave of parts is far slower) and >= 2 steps each."""
    return min(range(1, max(1, min(16, steps // 2, sms // tiles)) + 1),
               key=lambda s: cdiv(steps, s) + (6 + 3 * s if s > 1 else 0))


def _decode_warps(p: _Problem, kind: type[WgmmaDecodeWarpsConfig] = WgmmaDecodeWarpsConfig) -> list:
    """``DECODE_WARPS`` as ``kind`` (its op's config class): with the K split where its tiles leave SMs idle, as it
    is, and persistent."""
    base = kind(**vars(DECODE_WARPS))
    _, tiles, steps = decode_warps_work(p.m, p.n, p.kb, base)
    split = decode_warps_split(tiles, steps, p.sms)
    return ([replace(base, split_k=split)] if split > 1 else []) + [base, replace(base, persistent=True)]


def configs_for(m: int, n: int, k: int, device: torch.device) -> list[KernelConfig]:
    """Candidate configs for ``out[m, n] = a[m, k] @ b[n, k].T`` on ``device``, best guess first."""
    p = _Problem(m, n, k, device)
    rank = target.register_a_rank(device)
    convert = target.has_fp8_convert(device)  # the e4m3x2 -> f16x2 conversion instruction (SM89+)
    if m <= 2:
        return _gemv_m_le_2(p, rank, convert)
    out = _older_kernels(p, convert)
    if rank == 2:  # SM90: wgmma_register_a first; it replaces the bf16 mma
        out = _register_a(p) + [c for c in out if not isinstance(c, MmaBf16Config)]
    elif rank:
        out += _register_a(p)[:max(1, MAX_CONFIGS - len(out))]
    # SM90 with Gluon: the warp-specialized GEMM first for M > 128 (its TMA needs 16-byte weight rows: K % 32 == 0);
    # for 64 < M <= 128 the decode-warps GEMM after the first tile (N % 32 == 0: its boxes take rows the way the
    # scales are stored)
    if m > 128 and k % 32 == 0 and target.gluon_ok(device):
        out = (_warp_specialized(m, n) + out)[:MAX_CONFIGS]
    elif m > 64 and n % 32 == 0 and k % 32 == 0 and target.gluon_ok(device):
        out = (out[:1] + _decode_warps(p) + out[1:])[:MAX_CONFIGS]
    return out


# w4a16_mm: (block_m, block_n, k_blocks, warps, stages) of the tensor-core tiles by the largest M they serve, and
# (block_n, k_blocks) of the CUDA-core GEMV for M <= 8 (its rows: M rounded up to a power of two)
W4A16_MMA_TILES = {
    16: [(16, 64, 8, 4, 3), (16, 128, 8, 4, 3)],
    64: [(64, 64, 8, 4, 3), (32, 128, 8, 4, 3)],
    256: [(128, 128, 4, 8, 3), (64, 128, 8, 4, 3)],
    1 << 62: [(128, 256, 4, 8, 3), (128, 128, 4, 8, 4), (256, 128, 4, 8, 3)],
}
W4A16_GEMV_TILES = ((32, 16), (64, 8))
# gemv/tma_mma_w4a16 tiles (rows_per_quarter, k_blocks, k_warps, ctas_per_sm), first guesses: both tile heights at
# 2 CTAs per SM (R 8 doubles the tiles of an 8192-row weight); each ring the deepest (<= 6) that fits
TMA_MMA_W4A16_TILES = ((16, 32, 1, 2), (8, 32, 2, 2))
SMEM_SM90 = 227 * 1024  # the most shared memory one SM gives its CTAs


def _fill_split(tiles: int, steps: int, sms: int) -> int:
    """K parts that bring ``tiles`` up to about two per SM, with >= 2 K steps per part (1: enough tiles already)."""
    return max(1, min(16, steps // 2, cdiv(2 * sms, tiles))) if tiles < sms else 1


def w4a16_configs_for(m: int, n: int, k: int, device: torch.device) -> list[KernelConfig]:
    """Candidate configs for ``w4a16_mm`` (``out[m, n] = a[m, k] @ dequant(b[n, k]).T``, a bf16/fp16), best guess
    first. On SM90 the weight-as-register-operand tiles, then the ``tl.dot`` tiles (which win some small layers); with
    Gluon, as ``configs_for`` offers them, at 64 < M <= 128 the decode-warps GEMM after the first tile (N % 32 == 0
    and K % 32 == 0; at M = 1024 it lost to the register-operand tiles) and above M = 128 the warp-specialized GEMM
    first (K % 32 == 0; never swapped: ``_warp_specialized``), then the register-operand stream-K tile; elsewhere
    the ``tl.dot`` tiles, the CUDA-core GEMV for M <= 8, then (SM89, SM12x) the register-operand tiles. The GEMV is
    not offered on SM90, where it lost to both at every shape measured (docs/kernels.md)."""
    sms, kb = runtime.num_sms(device), k // 16
    out: list[KernelConfig] = []
    tiles = next(t for top, t in W4A16_MMA_TILES.items() if m <= top)
    for bm, bn, bkb, warps, stages in tiles:
        split = _fill_split(cdiv(m, bm) * cdiv(n, bn), cdiv(kb, bkb), sms)
        out.append(MmaW4A16Config(bm, bn, bkb, split, warps, stages))
    rank = target.register_a_rank(device)
    if m <= 8 and rank != 2:
        rows = 1 << (m - 1).bit_length()
        for bn, bkb in W4A16_GEMV_TILES:
            out.append(CudaCoreW4A16Config(rows, bn, bkb, _fill_split(cdiv(n, bn), cdiv(kb, bkb), sms), 4))
    if rank:
        register_a = _register_a_w4a16(_Problem(m, n, k, device))
        out = register_a + out if rank == 2 else out + register_a
    if m > 128 and k % 32 == 0 and target.gluon_ok(device):
        # then the register-operand stream-K tile, which the cut at MAX_CONFIGS left out behind the four
        # warp-specialized tiles from M = 257, where it won (at M = 300: RESULTS.md, "W4A16 candidates")
        sk = [c for c in out if getattr(c, "stream_k", False)]
        out = _warp_specialized(m, n, WgmmaWarpSpecializedW4A16Config) + sk + [c for c in out if c not in sk]
    elif 64 < m <= 128 and n % 32 == 0 and k % 32 == 0 and target.gluon_ok(device):
        out = out[:1] + _decode_warps(_Problem(m, n, k, device), WgmmaDecodeWarpsW4A16Config) + out[1:]
    elif m <= 16 and rank == 2 and n % 32 == 0 and k % 64 == 0 and target.gluon_ok(device):
        # first: on the H200 it beat the register-operand tiles (RESULTS.md). Only at K % 64 == 0, its swizzled token
        # lines: the whole-row token boxes (K % 64 == 32) have not run on a GPU yet (docs/kernels.md)
        out = tma_mma_w4a16(m) + out
    return out[:MAX_CONFIGS]


def tma_mma_w4a16(m: int) -> list[TmaMmaW4A16Config]:
    """``gemv/tma_mma_w4a16``'s tiles at M <= 16: its token box of 1, 8 or 16 rows, each ring as deep as fits (a
    stage: BW blocks of 4R weight rows at 8 bytes, their scales, BW * 32 bytes per token row)."""
    rows = 1 if m == 1 else 8 if m <= 8 else 16
    out = []
    for r, bw, kw, ctas in TMA_MMA_W4A16_TILES:
        stages = min(6, SMEM_SM90 // ctas // (bw * (36 * r + 32 * rows)))
        out.append(TmaMmaW4A16Config(rows, r, bw, stages, k_warps=kw, ctas_per_sm=ctas))
    return out


def _register_a_w4a16(p: _Problem) -> list[WgmmaRegisterAW4A16Config]:
    """``wgmma_register_a``'s tiles of M's range with their K split (the same registers and shared memory: its
    pre-decoded A tile is 16-bit too), and from M = 17 the first one as stream-K where a tile has more than one K
    step, as ``_register_a`` offers it."""
    out: list[WgmmaRegisterAW4A16Config] = []
    for tile in REGISTER_A_TILES[min(b for b in REGISTER_A_TILES if p.m <= b)]:
        if len(tile) == 6:  # the others differ by where A is decoded, which W4A16 does not do
            t = p.register_a(*tile)
            _add(out, WgmmaRegisterAW4A16Config(t.block_m, t.block_n, t.k_blocks, t.split_k, t.warps, t.stages))
    if p.m > 16 and cdiv(p.kb, out[0].k_blocks) > 1:
        out.append(replace(out[0], split_k=1, stream_k=True))
    return out


# The grouped kernels' tiles, by the rows an expert with rows gets on average. A decode batch gives each touched expert
# one row or a few: the per-expert GEMV (rows, block_n, k_blocks, warps; fp16x2 products, the dense GEMV's tiles for
# M <= 4), whose time is the touched weights' bytes. A prefill batch gives hundreds: tensor-core tiles (block_m,
# block_n, k_blocks, warps, stages) that reuse each decoded weight tile across more rows.
GROUPED_GEMV_TILES = {2: ((2, 4, 128, 2), (4, 16, 32, 4), (1, 4, 256, 4)), 8: ((4, 16, 32, 4), (8, 16, 32, 4))}
# the most rows per expert (``_per_expert``: T over min(E, T)) where the TMA-fed grouped GEMV is offered. It reads
# each weight tile once per 2 rows of an expert (from HBM again: the tiles in flight overrun the L2), so it wins
# where most touched experts have a row or two (RESULTS.md "MoE expert GEMM": B <= 8) and lost 2.7x at 4 rows
GROUPED_TMA_GEMV_ROWS = 1
GROUPED_MMA_TILES = {
    8: ((16, 64, 8, 4, 3),),
    64: ((16, 64, 8, 4, 3), (32, 64, 8, 4, 3), (64, 64, 8, 4, 3)),
    1 << 62: ((64, 128, 8, 8, 3), (128, 128, 8, 8, 2), (64, 64, 8, 4, 3)),
}


def _per_expert(t: int, e: int) -> int:
    """The rows a touched expert gets on average when T rows are routed over E experts (rounded up)."""
    return cdiv(t, max(1, min(e, t)))


def _grouped_tiles(t: int, e: int) -> tuple:
    """``GROUPED_MMA_TILES``' tiles for the rows an expert gets on average."""
    return next(v for top, v in GROUPED_MMA_TILES.items() if _per_expert(t, e) <= top)


def _register_a_grouped(t: int, e: int) -> list[MmaW4A16GroupedConfig]:
    """The grouped tiles with the weight as the register operand (its K order needs k_blocks % 4 == 0); for decode
    batches (at most 8 rows per expert on average, ``GROUPED_MMA_TILES``' first range) also the dense
    register-operand tiles of M <= 16, whose 16-block K steps were the fastest dense W4A16 tiles there
    (docs/kernels.md)."""
    tiles = [tile for tile in _grouped_tiles(t, e) if tile[2] % 4 == 0]
    if _per_expert(t, e) <= 8:
        for tile in REGISTER_A_TILES[16]:
            if len(tile) == 6 and tile[:5] not in tiles:  # the grouped kernel does not split K
                tiles.append(tile[:5])
    return [MmaW4A16GroupedConfig(*tile, register_a=True) for tile in tiles]


def _with_register_a(plain: list, register_a: list, device: torch.device) -> list[KernelConfig]:
    """``register_a`` first on SM90, after ``plain`` elsewhere from SM89, left out before; at most MAX_CONFIGS."""
    rank = target.register_a_rank(device)
    out = register_a + plain if rank == 2 else plain + register_a if rank else plain
    return out[:MAX_CONFIGS]


def _tma_gemv_grouped(t: int, e: int, n: int, k: int, device: torch.device) -> list[KernelConfig]:
    """The TMA-fed grouped GEMV for decode batches (SM90 with Gluon; N % 128 == 0, K % 32 == 0): ``TMA_GEMV_TILES``'
    first tile at 2 rows per pass (a pass of an expert's last single row skips the second row's work) and 1, the
    second tile at 1 (at 2, its register cap for 3 CTAs per SM leaves the int8 dot products' table out of registers:
    tests/test_gluon_sass.py). Placed first, ahead of ``_with_register_a``'s order: the dense GEMV it extends is the
    fastest weight stream at M <= 2."""
    if _per_expert(t, e) > GROUPED_TMA_GEMV_ROWS or n % 128 or k % 32 or not target.gluon_ok(device):
        return []
    (r, bw, st, c), (r2, bw2, st2, c2) = TMA_GEMV_TILES
    return [TmaGemvGroupedConfig(2, r, bw, st, warps=4, ctas_per_sm=c, int8_dot=True),
            TmaGemvGroupedConfig(1, r, bw, st, warps=4, ctas_per_sm=c, int8_dot=True),
            TmaGemvGroupedConfig(1, r2, bw2, st2, warps=4, ctas_per_sm=c2, int8_dot=True)]


def grouped_configs_for(t: int, e: int, n: int, k: int, device: torch.device) -> list[KernelConfig]:
    """Candidate configs for ``fp4_grouped_mm`` (T routed rows over E experts, each [N, K]), best guess first: on SM90
    for decode batches the TMA-fed grouped GEMV; from SM89 also ``w4a16_grouped_mm``'s register-operand tiles on the
    tokens decoded first (on SM90 those before the rest)."""
    out: list[KernelConfig] = []
    gemv = next((v for top, v in GROUPED_GEMV_TILES.items() if _per_expert(t, e) <= top), ())
    for rows, bn, bkb, warps in gemv:
        out.append(GemvGroupedConfig(rows, bn, bkb, warps, prefetch=bn > 4, max_registers=64 if bkb > 128 else None))
    out += [MmaGroupedConfig(bm, bn, bkb, warps, stages) for bm, bn, bkb, warps, stages in _grouped_tiles(t, e)]
    tma = _tma_gemv_grouped(t, e, n, k, device)
    return (tma + _with_register_a(out, _register_a_grouped(t, e), device))[:MAX_CONFIGS]


def w4a16_grouped_configs_for(t: int, e: int, n: int, k: int, device: torch.device) -> list[KernelConfig]:
    """Candidate configs for ``w4a16_grouped_mm``: the grouped tensor-core tiles of ``grouped_configs_for`` (no GEMV
    family reads 16-bit activations per expert yet), best guess first; on SM90 each first with the weight as the
    register operand (``register_a``; elsewhere from SM89 after the plain ones)."""
    plain = [MmaW4A16GroupedConfig(bm, bn, bkb, warps, stages) for bm, bn, bkb, warps, stages in _grouped_tiles(t, e)]
    return _with_register_a(plain, _register_a_grouped(t, e), device)
