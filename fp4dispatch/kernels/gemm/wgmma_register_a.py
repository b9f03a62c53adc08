"""``wmma``: the tensor-core NVFP4 GEMM with the weight as the register operand (``WgmmaRegisterAConfig``, SM89+;
on SM90 the first candidate from M = 3 to 128), its A pre-decode (:func:`predecode`, also used by the Gluon GEMMs)
and launcher.

``acc[BN, BM] = W @ A.T``: the weight tile is the first ``tl.dot`` operand, which Hopper's wgmma reads from
registers, so the decoded weight never goes through shared memory; only the small activation tile does. For that to
hold, the decode has to happen in the dot-operand register layout itself. The K order of a tile is free (A and W are
decoded by the same function, and a dot sums over K), so ``_dec16`` lays out each group of 4 consecutive 16-blocks
so that the 4 lanes sharing a row in the wgmma operand layout each get the 16 values of one block. Triton then
propagates that layout back to the raw words (checked in the TTGIR: no ``local_alloc`` of the decoded weight).

Values: a nibble pair becomes fp16x2 bits (``_pair``: e2m1 * 2**-14), one ``mul.rn.f16x2`` applies the block scale
(e4m3 * 2**7, exact in fp16), so every operand is e2m1 * e4m3 * 2**-7, exact in fp16 (products are multiples of
2**-17, below 21). The dot accumulates in fp32; the epilogue multiplies by 2**14 (exact), then alpha. With ``CVT``
the nibbles go through e4m3 bytes and ``cvt.rn.f16x2.e4m3x2`` instead (``numerics.fp16x2._cvt4``: 11 instructions per 8
values instead of 16; e2m1 * 2**-6), so operands are e2m1 * e4m3 * 2 (at most 5376, exact in fp16) and the epilogue
multiplies by 2**-2. Under the interpreter (no PTX) the same values are formed in fp32 and the dot runs in fp32.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

import torch

from .. import runtime, workspace
from ..config import WgmmaRegisterAConfig, register_a_resident
from ..numerics.e2m1_e4m3 import e4m3_to_f32, swz_row
from ..numerics.bf16x2 import pair_bf16, scale_bf16x2, scaled_bf16
from ..numerics.fp16x2 import _cvt4, _halves, _pair
from ..tiles import (gdc_launch_dependents, grid_tile, k_part, pdl_wait, store_out, stream_piece, stream_range,
                     stream_store)

WMMA_UNDO = tl.constexpr(16384.0)  # 2**14: undoes 2**-7 on each operand
WMMA_UNDO_CVT = tl.constexpr(0.25)  # 2**-2: undoes the factor 2 on each operand of the CVT decode


@triton.jit
def _scaled(p, sc, ASM: tl.constexpr):
    """Pair bits p (two fp16 of e2m1 times a power of two: ``_pair``'s 2**-14, ``_cvt4``'s 2**-6) times the block
    scale ``sc`` from ``_scale``: fp16x2 bits (ASM) or an (lo, hi) fp32 tuple."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [p, sc], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        lo, hi = _halves(p)
        return lo * sc, hi * sc


@triton.jit
def _join8(p0, p1, p2, p3, p4, p5, p6, p7):
    return tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))


@triton.jit
def _k_order(q, R: tl.constexpr, BKB: tl.constexpr):
    """[R, BKB, 8 pairs] -> [R, BKB/4 groups, 8 pairs, 4 blocks]: the block index goes next to the pair's two halves,
    which is where the wgmma operand layout puts its 4 lanes of a row."""
    return tl.permute(tl.reshape(q, (R, BKB // 4, 4, 8)), (0, 1, 3, 2))


@triton.jit
def to_k_order(x, BKB: tl.constexpr):
    """[R, BKB*16] 16-bit values in K order -> the column order of :func:`_dec16` without CVT (a permutation in
    registers, by groups of 4 blocks): column ``g*64 + f*8 + b*2 + h`` holds block ``4g + b``'s half h of pair J
    (``_pair``: nibbles J%4 + 4h of word J//4), where J is f with its 3 bits reversed (``_join8`` nests joins, and
    each adds the last axis). So K within a group is (block, word, h, j1, j0) with nibble j = 2 j1 + j0, and the
    columns are (j0, j1, word, block, h)."""
    R: tl.constexpr = x.shape[0]
    q = tl.permute(tl.reshape(x, (R, BKB // 4, 4, 2, 2, 2, 2)), (0, 1, 6, 5, 3, 2, 4))
    return tl.reshape(q, (R, BKB * 16))


@triton.jit
def _scale_cols(t):
    """Swizzled scale column of block t within a K step that starts on a whole group of 4 blocks."""
    return (t // 4) * 512 + t % 4


@triton.jit
def _scale(s, ASM: tl.constexpr):
    """e4m3 scale bytes -> scale * 2**7: as fp16x2 bits (s, s) when ASM, else fp32."""
    if ASM:
        # cvt.rn.f16x2.e4m3x2 (SM89+; NaN stays NaN), * 2**7 and the copy to both halves: 4 instructions a scale
        return tl.inline_asm_elementwise(
            "{ .reg .b16 b; .reg .b32 h, c; cvt.u16.u32 b, $1; cvt.rn.f16x2.e4m3x2 h, b; mov.b32 c, 0x58005800; "
            "mul.rn.f16x2 h, h, c; prmt.b32 $0, h, h, 0x1010; }",
            "=r,r", [s.to(tl.uint32)], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return e4m3_to_f32(s) * 128.0


@triton.jit
def _dec16(x, s, BKB: tl.constexpr, ASM: tl.constexpr, CVT: tl.constexpr = False, BF16: tl.constexpr = False):
    """int64 words [R, BKB] (one 16-block each) and their e4m3 scale bytes -> [R, BKB*16] operand values
    (e2m1 * e4m3 * 2**-7, with CVT * 2; fp16 when ASM, bf16 with BF16, else fp32) in this kernel's K order (a fixed
    permutation within each group of 4 blocks, :func:`to_k_order` without CVT; both operands use it, and CVT pairs
    other nibbles: A and W need the same CVT)."""
    if ASM and BF16:
        v = _dec16_bf16(x, s, BKB)
    else:
        v = _dec16_f16(x, s, BKB, ASM, CVT)
    return v


@triton.jit
def _dec16_bf16(x, s, BKB: tl.constexpr):
    """``_dec16``'s bf16 values (PTX: ``numerics/bf16x2.py``), in the K order of its fp16 decode without CVT."""
    R: tl.constexpr = x.shape[0]
    lo = x.to(tl.uint32)
    hi = (x >> 32).to(tl.uint32)
    sb = scale_bf16x2(s)
    q = _join8(scaled_bf16(pair_bf16(lo, 0), sb), scaled_bf16(pair_bf16(lo, 1), sb),
               scaled_bf16(pair_bf16(lo, 2), sb), scaled_bf16(pair_bf16(lo, 3), sb),
               scaled_bf16(pair_bf16(hi, 0), sb), scaled_bf16(pair_bf16(hi, 1), sb),
               scaled_bf16(pair_bf16(hi, 2), sb), scaled_bf16(pair_bf16(hi, 3), sb))
    b_lo, b_hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [_k_order(q, R, BKB)],
                                           dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    return tl.reshape(tl.join(b_lo.to(tl.bfloat16, bitcast=True), b_hi.to(tl.bfloat16, bitcast=True)),
                      (R, BKB * 16))


@triton.jit
def _dec16_f16(x, s, BKB: tl.constexpr, ASM: tl.constexpr, CVT: tl.constexpr):
    """``_dec16``'s fp16 (ASM) or fp32 values."""
    R: tl.constexpr = x.shape[0]
    lo = x.to(tl.uint32)
    hi = (x >> 32).to(tl.uint32)
    sc = _scale(s, ASM)
    if ASM:
        if CVT:
            c0, c1, c2, c3 = _cvt4(lo)
            c4, c5, c6, c7 = _cvt4(hi)
            q = _join8(_scaled(c0, sc, ASM), _scaled(c1, sc, ASM), _scaled(c2, sc, ASM), _scaled(c3, sc, ASM),
                       _scaled(c4, sc, ASM), _scaled(c5, sc, ASM), _scaled(c6, sc, ASM), _scaled(c7, sc, ASM))
        else:
            q = _join8(_scaled(_pair(lo, 0), sc, ASM), _scaled(_pair(lo, 1), sc, ASM),
                       _scaled(_pair(lo, 2), sc, ASM), _scaled(_pair(lo, 3), sc, ASM),
                       _scaled(_pair(hi, 0), sc, ASM), _scaled(_pair(hi, 1), sc, ASM),
                       _scaled(_pair(hi, 2), sc, ASM), _scaled(_pair(hi, 3), sc, ASM))
        v_lo, v_hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [_k_order(q, R, BKB)],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        l0, h0 = _scaled(_pair(lo, 0), sc, ASM)
        l1, h1 = _scaled(_pair(lo, 1), sc, ASM)
        l2, h2 = _scaled(_pair(lo, 2), sc, ASM)
        l3, h3 = _scaled(_pair(lo, 3), sc, ASM)
        l4, h4 = _scaled(_pair(hi, 0), sc, ASM)
        l5, h5 = _scaled(_pair(hi, 1), sc, ASM)
        l6, h6 = _scaled(_pair(hi, 2), sc, ASM)
        l7, h7 = _scaled(_pair(hi, 3), sc, ASM)
        v_lo = _k_order(_join8(l0, l1, l2, l3, l4, l5, l6, l7), R, BKB)
        v_hi = _k_order(_join8(h0, h1, h2, h3, h4, h5, h6, h7), R, BKB)
    return tl.reshape(tl.join(v_lo, v_hi), (R, BKB * 16))


@triton.jit
def wmma_prep_a_kernel(a_ptr, sa_ptr, ad_ptr, M, KB, CB, BR: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
                       PDL: tl.constexpr = False, CVT: tl.constexpr = False, EARLY: tl.constexpr = False):
    """A decoded once into ad [M, ceil(KB/4)*64] (fp16; fp32 under the interpreter) in wmma's K order, so that
    wmma with APRE streams A tiles straight into shared memory instead of decoding them again for every N tile.
    PDL: see ``pdl_wait``. EARLY (with PDL): each CTA lets the next kernel launch once its own wait is over (so the
    kernels before this one are done), for a next kernel that waits only where it reads ad (``pdl_after_predecode``)."""
    pdl_wait(PDL)
    if PDL and EARLY:
        gdc_launch_dependents()
    rm = tl.program_id(0) * BR + tl.arange(0, BR)
    kb0 = tl.program_id(1) * BKB
    t = tl.arange(0, BKB)
    mask = (rm[:, None] < M) & (kb0 + t[None, :] < KB)
    xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * KB + kb0 + t[None, :], mask=mask, other=0)
    sa = tl.load(sa_ptr + swz_row(rm, CB)[:, None] + (kb0 // 4) * 512 + _scale_cols(t)[None, :], mask=mask, other=0)
    # K is padded to whole groups of 4 blocks: the K order spreads a group's blocks over all of its 64 columns
    KP = (KB + 3) // 4 * 64
    kk = kb0 * 16 + tl.arange(0, BKB * 16)
    omask = (rm[:, None] < M) & (kk[None, :] < KP)
    tl.store(ad_ptr + rm[:, None].to(tl.int64) * KP + kk[None, :], _dec16(xa, sa, BKB, ASM, CVT), mask=omask)


@triton.jit
def _wmma_steps(a_ptr, b_ptr, sa_ptr, sb_ptr, rn, rm, M, N, KB, CB, kb_lo, kb_hi, BM: tl.constexpr, BN: tl.constexpr,
                BKB: tl.constexpr, ASM: tl.constexpr, APRE: tl.constexpr, CVT: tl.constexpr):
    """acc [BN, BM] = W @ A.T over 16-blocks [kb_lo, kb_hi) (kb_lo a multiple of BKB), with the operand scale undone."""
    t = tl.arange(0, BKB)
    scol = _scale_cols(t)
    brow = swz_row(rn, CB)
    arow = swz_row(rm, CB)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        kk = kb0 + t
        bmask = (rn[:, None] < N) & (kk[None, :] < kb_hi)
        amask = (rm[:, None] < M) & (kk[None, :] < kb_hi)
        xb = tl.load(b_ptr + rn[:, None].to(tl.int64) * KB + kk[None, :], mask=bmask, other=0)
        sb = tl.load(sb_ptr + brow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=bmask, other=0)
        if APRE:
            k16 = kb0 * 16 + tl.arange(0, BKB * 16)
            wa = tl.load(a_ptr + rm[:, None].to(tl.int64) * ((KB + 3) // 4 * 64) + k16[None, :],
                         mask=(rm[:, None] < M) & (k16[None, :] < (kb_hi + 3) // 4 * 64), other=0)
        else:
            xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * KB + kk[None, :], mask=amask, other=0)
            sa = tl.load(sa_ptr + arow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=amask, other=0)
            wa = _dec16(xa, sa, BKB, ASM, CVT)
        acc = tl.dot(_dec16(xb, sb, BKB, ASM, CVT), tl.trans(wa), acc)
    if CVT:
        acc = acc * WMMA_UNDO_CVT
    else:
        acc = acc * WMMA_UNDO
    return acc


@triton.jit
def wmma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB,
                blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr,
                ASM: tl.constexpr, APRE: tl.constexpr = False, PDL: tl.constexpr = False, CVT: tl.constexpr = False):
    """Tensor-core GEMM over int64 words (a, b viewed as int64 [rows, K/16]), weight as the register operand:
    tile [BN, BM] of out.T per CTA, K split by program_id(1) (SPLIT: the tile's last CTA sums, see ``store_out``).
    APRE: a_ptr is A already decoded by ``wmma_prep_a_kernel`` (K padded to groups of 4 blocks, this K order, the
    same CVT). CVT (ASM only): the decode through e4m3 bytes. PDL: see ``pdl_wait``."""
    pdl_wait(PDL)
    pid_k, rn, rm, _ = grid_tile(BN, BM, BKB)
    kb_lo, kb_hi = k_part(pid_k, blocks_per_split, KB, BKB)
    acc = _wmma_steps(a_ptr, b_ptr, sa_ptr, sb_ptr, rn, rm, M, N, KB, CB, kb_lo, kb_hi, BM, BN, BKB, ASM, APRE, CVT)
    store_out(tl.trans(acc), rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


@triton.jit
def wmma_sk_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB, NT, TILES,
                   STEPS, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
                   APRE: tl.constexpr = False, PDL: tl.constexpr = False, CVT: tl.constexpr = False):
    """``wmma_kernel`` with stream-K (``tiles.stream_range``: one equal range of all tiles' K steps per CTA, a tile
    cut between CTAs summed in CTA order, deterministic)."""
    pdl_wait(PDL)
    c, p, total, it, hi = stream_range(TILES, STEPS)
    while it < hi:
        tile, start, s0, s1, rn, rm = stream_piece(it, hi, STEPS, NT, BN, BM)
        acc = tl.trans(_wmma_steps(a_ptr, b_ptr, sa_ptr, sb_ptr, rn, rm, M, N, KB, CB, s0 * BKB,
                                   tl.minimum(s1 * BKB, KB), BM, BN, BKB, ASM, APRE, CVT))
        stream_store(acc, tile, start, STEPS, total, c, p, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr)
        it = start + s1


@functools.lru_cache(maxsize=256)
def stream_parts(tiles: int, steps: int, ctas: int) -> int:
    """Most CTAs that share one tile under ``wmma_sk_kernel``'s cut (CTA c starts at step c * total // ctas): the
    depth of the split-K workspace."""
    total = tiles * steps
    return max(((t + 1) * steps * ctas - 1) // total - ((t * steps + 1) * ctas - 1) // total + 1 for t in range(tiles))


def stream_grid(m: int, n: int, kb: int, cfg, out: torch.Tensor) -> tuple:
    """A stream-K launch of ``cfg``'s tile (``WgmmaRegisterAConfig`` or its W4A16 form) over out [m, n] and kb
    16-blocks: (N tiles, tiles, K steps per tile, CTAs: ``stream_ctas`` or as many as fit, the split-K workspace and
    counters). Where no tile is cut they are one fp32 partial and a counter, never touched, but of the types the
    kernel's cut-tile branch is compiled for, whatever the launch (an int32 atomic does not compile on out's dtype)."""
    nt, steps = runtime.cdiv(n, cfg.block_n), runtime.cdiv(kb, cfg.k_blocks)
    tiles = nt * runtime.cdiv(m, cfg.block_m)
    ctas = min(tiles * steps,
               cfg.stream_ctas or runtime.num_sms(out.device) * register_a_resident(cfg.block_m, cfg.warps))
    parts = stream_parts(tiles, steps, ctas)
    ws, cnt = workspace.buffers(*((m, n, parts, tiles) if parts > 1 else (1, 1, 1, 1)), out.device)
    return nt, tiles, steps, ctas, ws, cnt


def pdl_after_predecode(pdl: dict) -> tuple[dict, dict]:
    """(pre-decode options, launch options) of a Gluon kernel that runs after :func:`predecode` with PDL (``pdl``:
    ``runtime.pdl``'s): the pre-decode lets the kernel launch as soon as the kernels before it are done (EARLY), and
    the kernel waits for the pre-decode only where it loads the decoded operand."""
    return ({**pdl, "EARLY": True}, {"launch_pdl": True}) if pdl else ({}, {})


def k_order_width(k: int) -> int:
    """Columns of a row in the decode's K order: K padded to whole groups of 4 blocks (the row stride of
    ``predecode``'s output and of ``wgmma_register_a_w4a16.permute_a``'s)."""
    return runtime.cdiv(k // 16, 4) * 64


def predecode(a64: torch.Tensor, sa: torch.Tensor, asm: bool, tile: tuple = (16, 16, 4), **opts) -> torch.Tensor:
    """One operand (int64 words [m, kb], swizzled scale bytes ``sa``: A, or the weight in a swapped
    ``wgmma_warp_specialized``) decoded once into [m, ceil(kb/4)*64] in this kernel's K order, fp16 (fp32 in the
    interpreter, ``asm`` False); ``tile``: (rows, 16-blocks, warps) per CTA; ``opts``: the PDL and CVT options."""
    (m, kb), (br, bkb, warps) = a64.shape, tile
    if bkb % 4:  # the scale swizzle and the K order both go by groups of 4 blocks
        raise ValueError(f"predecode: tile[1] (16-blocks per CTA) must be a multiple of 4; got tile={tile}")
    dt = torch.float16 if asm else torch.float32
    ad = workspace.scratch("predecode", (m, k_order_width(16 * kb)), dt, a64.device)
    runtime.launch(wmma_prep_a_kernel, (runtime.cdiv(m, br), runtime.cdiv(kb, bkb)), a64, sa, ad, m, kb,
                   runtime.cdiv(kb, 4), BR=br, BKB=bkb, ASM=asm, num_warps=warps, **opts)
    return ad


# STEPS_NOTE: with one K step per tile, stream-K has nothing to stream, and Triton 3.6 could not compile the stream-K
# kernel there (N=4096 K=128 at M=128 on the H200: a crash in its coalesce pass): the tile-per-CTA kernel runs it
# instead, which sums each tile's one step in the same order


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaRegisterAConfig) -> None:
    """Launch ``wmma_kernel`` (an (N tile, K part, M tile) grid) or, with ``stream_k``, ``wmma_sk_kernel`` (one wave
    of CTAs) on canonical operands (scales as uint8), after :func:`predecode` with ``predecode_a``."""
    m, n, kb = a.shape[0], b.shape[0], a.shape[1] // 8
    cb, bm, bn = runtime.cdiv(kb, 4), cfg.block_m, cfg.block_n
    asm, a64 = not runtime.jit_interpreted(), a.view(torch.int64)
    pdl = runtime.pdl(out.device, cfg.pdl)
    # the interpreter forms the same values in fp32 whichever decode the config names
    cvt = {"CVT": True} if asm and cfg.e4m3x2_convert else {}
    if cfg.predecode_a:
        a64 = predecode(a64, sa, asm, **pdl, **cvt)
    opts = dict(BM=bm, BN=bn, BKB=cfg.k_blocks, ASM=asm, APRE=cfg.predecode_a, num_warps=cfg.warps,
                num_stages=cfg.stages, **runtime.register_cap(cfg.max_registers), **pdl, **cvt)
    if cfg.stream_k and runtime.cdiv(kb, cfg.k_blocks) > 1:  # else: below (STEPS_NOTE)
        nt, tiles, steps, ctas, ws, cnt = stream_grid(m, n, kb, cfg, out)
        runtime.launch(wmma_sk_kernel, (ctas,), a64, b.view(torch.int64), sa, sb, alpha, out, ws, cnt, m, n, kb, cb,
                       nt, tiles, steps, **opts)
        return
    split, per = runtime.k_split(kb, cfg.k_blocks, cfg.split_k)
    grid = (runtime.cdiv(n, bn), split, runtime.cdiv(m, bm))
    ws, cnt = workspace.buffers(m, n, split, grid[0] * grid[2], out.device) if split > 1 else (out, out)
    runtime.launch(wmma_kernel, grid, a64, b.view(torch.int64), sa, sb, alpha, out, ws, cnt, m, n, kb, cb, per,
                   SPLIT=split > 1, **opts)
