"""``gemv/tma_warp_specialized_grouped``: ``fp4_grouped_mm`` for decode batches on SM90 in Gluon
(``TmaGemvGroupedConfig``): ``gemv/tma_warp_specialized``'s TMA-fed GEMV over every touched expert in one launch.
Only imported where :func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

A decode step gives each touched expert a row or a few, so the call is a GEMV per touched expert and its time is the
touched weights' bytes over the bandwidth reached; the dense TMA GEMV is this package's fastest weight stream at
M <= 2. Here its ring, steps and stores run unchanged over *items*: (expert with rows, N tile, chunk of ``rows``
rows of that expert), in that order, so the chunks of one expert's tile follow each other on one CTA (each chunk
still reads the tile from HBM: the tiles in flight overrun the L2; a chunk of one row skips the second row's work).
A persistent grid of ``ctas_per_sm`` CTAs per SM shares out the items, which
both partitions count from ``offs`` on the GPU (no host sync: one CUDA graph serves every routing; an expert
without rows makes no item). The boxes of the grouped operands:

- weight words and scales: ``b`` [E, N, K/2] is the dense kernel's [E*N, K/2] and the swizzled ``b_scale``
  [E, N, K/16] its [E*N, K/16] when N % 128 == 0 (each expert's scales are then whole 128-row groups), so a tile of
  expert e starts at 128-row group ``e * N/128``;
- activation words: a box of ``rows`` rows from the chunk's first row (rows past the expert's are read and not
  stored; past T, zero-filled);
- activation scales: expert e's rows start at the 128-aligned row P[e] of the grouped swizzled layout, so the
  chunk's rows are consecutive ``i`` of one quarter ``q``: the dense box of rows ``i..`` (all four quarters' bytes;
  a box that started at column ``4i + q`` instead, 4 bytes past a 16-byte boundary at q = 1, was an illegal
  instruction on the H200), and the consumers read quarter q's bytes of it (``_act``).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .. import runtime
from ..config_grouped import TmaGemvGroupedConfig
from ..gemm.gluon_tiles import first_tile
from ..runtime import launch
from .tma_warp_specialized import _dp4_table, _step, _store, _undo, descriptors, reg_cap, ring, word_layout


@triton.constexpr_function
def lanes(warps: int) -> gl.BlockedLayout:
    """One value per thread over ``warps`` warps: the experts' vectors, 32 * warps experts at a time."""
    return gl.BlockedLayout([1], [32], [getattr(warps, "value", warps)], [0])


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _max(x, y):
    return gl.maximum(x, y)


@gluon.jit
def find_item(offs_ptr, item, T, E, TPE, MB: gl.constexpr):
    """The expert that owns ``item`` -> (expert, its first row, its rows, its first padded scale row, its first item),
    and the number of items. ``offs`` is clamped to [0, T] and made non-decreasing (as ``expert_rows`` does), so a
    wrong table cannot make a box or a store leave the operands; an expert of r rows owns ceil(r / MB) * TPE items.
    The experts are read 32 * num_warps at a time, with running carries, so the registers do not grow with E."""
    W: gl.constexpr = 32 * gl.num_warps()
    L: gl.constexpr = lanes(gl.num_warps())
    s_c = T * 0
    e_c = T * 0
    done = T * 0
    pad = T * 0
    expert = T * 0
    row0 = T * 0
    rows_o = T * 0
    pad0 = T * 0
    first = T * 0
    for c in range(0, E, W):
        e = c + gl.arange(0, W, layout=L)
        ends = gl.minimum(gl.maximum(gl.load(offs_ptr + e, mask=e < E, other=0), 0), T)
        ends = gl.maximum(gl.associative_scan(ends, 0, _max), e_c)
        starts = gl.minimum(gl.maximum(gl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0), 0), T)
        starts = gl.maximum(gl.associative_scan(starts, 0, _max), s_c)
        rows = gl.where(e < E, ends - starts, 0)
        items = (rows + MB - 1) // MB * TPE
        last = gl.associative_scan(items, 0, _add) + done
        padded = (rows + 127) // 128 * 128
        mine = (last > item) & (last - items <= item)
        expert += gl.sum(gl.where(mine, e, 0), 0)
        row0 += gl.sum(gl.where(mine, starts, 0), 0)
        rows_o += gl.sum(gl.where(mine, rows, 0), 0)
        pad0 += gl.sum(gl.where(mine, gl.associative_scan(padded, 0, _add) - padded + pad, 0), 0)
        first += gl.sum(gl.where(mine, last - items, 0), 0)
        done = gl.max(last, 0)
        pad += gl.sum(padded, 0)
        s_c = gl.max(starts, 0)
        e_c = gl.max(ends, 0)
    return expert, row0, rows_o, pad0, first, done


@gluon.jit
def _span(offs_ptr, item, hi, T, E, TPE, MB: gl.constexpr):
    """The owner of ``item`` (``find_item``), its chunks and the end of its items on this CTA (at least item + 1)."""
    expert, row0, rows, pad0, first, _ = find_item(offs_ptr, item, T, E, TPE, MB)
    chunks = gl.maximum((rows + MB - 1) // MB, 1)
    return expert, row0, rows, pad0, first, chunks, gl.maximum(gl.minimum(hi, first + chunks * TPE), item + 1)


@gluon.jit
def _producer(w_desc, ws_desc, a_desc, as_desc, w_s, ws_s, a_s, as_s, ready, empty, offs_ptr, T, N, E, STEPS):
    """TMA loads of this CTA's items, step after step, into the ring."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    BW: gl.constexpr = w_s.type.shape[3]
    MB: gl.constexpr = a_s.type.shape[1]
    NBYTES: gl.constexpr = 4 * R * BW * 8 + R * BW * 4 + MB * BW * 8 + MB * BW * 4
    TPE = (N // 128) * (32 // R)
    total = find_item(offs_ptr, -1, T, E, TPE, MB)[5]
    lo = first_tile(gl.program_id(0), total)
    hi = first_tile(gl.program_id(0) + 1, total)
    item = lo
    while item < hi:
        expert, row0, rows, pad0, first, chunks, end = _span(offs_ptr, item, hi, T, E, TPE, MB)
        for cur in range(item, end):
            local = cur - first
            tile = local // chunks
            r0 = (local % chunks) * MB
            g = expert * (N // 128) + tile // (32 // R)
            i0 = (tile % (32 // R)) * R
            sr = pad0 + r0
            for ks in range(STEPS):
                it = (cur - lo) * STEPS + ks
                kw = ks * BW
                s = it % STAGES
                # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), NBYTES)
                tma.async_copy_global_to_shared(w_desc, [4 * g, i0, kw], ready.index(s), w_s.index(s))
                tma.async_copy_global_to_shared(ws_desc, [g, kw // 4, 4 * i0], ready.index(s), ws_s.index(s))
                tma.async_copy_global_to_shared(a_desc, [row0 + r0, kw], ready.index(s), a_s.index(s))
                tma.async_copy_global_to_shared(as_desc, [sr // 128, kw // 4, 4 * (sr % 32)], ready.index(s),
                                                as_s.index(s))
        item = end


@gluon.jit
def _consume(w_s, ws_s, a_s, as_s, ready, empty, alpha_ptr, out_ptr, offs_ptr, T, N, E, STEPS, ALPHA_STRIDE,
             DP: gl.constexpr):
    """For each of this CTA's items: the dot products of its 4R weight rows with the chunk's rows, then the stores of
    the rows that are the expert's."""
    R: gl.constexpr = w_s.type.shape[2]
    BW: gl.constexpr = w_s.type.shape[3]
    MB: gl.constexpr = a_s.type.shape[1]
    LW: gl.constexpr = word_layout(BW, gl.num_warps())
    tbl = _dp4_table(N)
    TPE = (N // 128) * (32 // R)
    total = find_item(offs_ptr, -1, T, E, TPE, MB)[5]
    lo = first_tile(gl.program_id(0), total)
    hi = first_tile(gl.program_id(0) + 1, total)
    item = lo
    it = 0  # ring steps consumed
    while item < hi:
        expert, row0, rows, pad0, first, chunks, end = _span(offs_ptr, item, hi, T, E, TPE, MB)
        alpha = gl.load(alpha_ptr + expert * ALPHA_STRIDE)
        for cur in range(item, end):
            acc0 = gl.zeros([4, R, BW // 4, 4], gl.float32, LW)
            acc1 = acc0
            r0 = ((cur - first) % chunks) * MB
            q = (r0 % 128) // 32  # (the expert's scales start at a multiple of 128 rows)
            if q == 0 and MB > 1 and rows - r0 == 1:  # a pass of one row (most experts of a decode batch)
                for ks in range(STEPS):
                    acc0, acc1 = _step(w_s, ws_s, a_s, as_s, ready, empty, it + ks, acc0, acc1, tbl, LW, DP, 0,
                                       False)
            elif q == 0:  # an expert's first 32 rows: the loop without the choice of quarter
                for ks in range(STEPS):
                    acc0, acc1 = _step(w_s, ws_s, a_s, as_s, ready, empty, it + ks, acc0, acc1, tbl, LW, DP)
            else:
                for ks in range(STEPS):
                    acc0, acc1 = _step(w_s, ws_s, a_s, as_s, ready, empty, it + ks, acc0, acc1, tbl, LW, DP, q)
            it += STEPS
            # (the tile from cur after the loop: fewer values live across it)
            tile = (cur - first) // chunks
            n0 = (tile // (32 // R)) * 128 + (tile % (32 // R)) * R
            out_rows = out_ptr + (row0 + r0).to(gl.int64) * N
            _store(acc0, 0, n0, rows - r0, N, alpha, out_rows, LW, _undo(DP))
            if MB > 1:
                _store(acc1, 1, n0, rows - r0, N, alpha, out_rows, LW, _undo(DP))
        item = end


@gluon.jit
def grouped_gvws_kernel(w_desc, ws_desc, a_desc, as_desc, alpha_ptr, out_ptr, offs_ptr, T, N, E, STEPS,
                        ALPHA_STRIDE, R: gl.constexpr, BW: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr,
                        DP: gl.constexpr = False):
    """out [T, N]: each expert's rows times its weight, over the items of ``find_item`` (4R weight rows by up to MB
    rows of one expert, STEPS steps of BW 16-blocks each); the default partition (num_warps) consumes, a worker warp
    loads. ALPHA_STRIDE: 1 for one alpha per expert, 0 for one in all."""
    w_s, ws_s, a_s, as_s, ready, empty = ring(w_desc, ws_desc, a_desc, as_desc, R, BW, MB, STAGES)
    gl.warp_specialize([(_consume, (w_s, ws_s, a_s, as_s, ready, empty, alpha_ptr, out_ptr, offs_ptr, T, N, E, STEPS,
                                    ALPHA_STRIDE, DP)),
                        (_producer, (w_desc, ws_desc, a_desc, as_desc, w_s, ws_s, a_s, as_s, ready, empty, offs_ptr,
                                     T, N, E, STEPS))], [1], [40])


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        offs: torch.Tensor, cfg: TmaGemvGroupedConfig) -> None:
    """Launch ``grouped_gvws_kernel`` on canonical grouped operands (swizzled scales as uint8) after the checks its
    TMA boxes need: a persistent grid of ``ctas_per_sm`` CTAs per SM, at most one per item a routing can make."""
    t, kb = a.shape[0], a.shape[1] // 8
    e, n = b.shape[0], b.shape[1]
    if n % 128 or kb % 2 or any(x.data_ptr() % 16 for x in (a, b, sa, sb)):
        raise ValueError(f"fp4_grouped_mm: {type(cfg).__name__} needs N % 128 == 0, K % 32 == 0 and 16-byte aligned "
                         f"operands; got N={n}, K={kb * 16}, data_ptr() % 16 of (a, b, a_scale, b_scale) = "
                         f"{tuple(x.data_ptr() % 16 for x in (a, b, sa, sb))}. Use another config from "
                         f"grouped_configs_for()")
    if t == 0:
        return
    r, bw, mb = cfg.rows_per_quarter, cfg.k_blocks, cfg.rows
    most = (runtime.cdiv(t, mb) + min(e, t)) * (n // 128) * (32 // r)
    launch(grouped_gvws_kernel, (min(most, runtime.num_sms(out.device) * cfg.ctas_per_sm),),
           *descriptors(a, b.view(e * n, kb * 8), sa, sb, r, bw, mb), alpha, out, offs, t, n, e,
           runtime.cdiv(kb, bw), int(alpha.numel() > 1), R=r, BW=bw, MB=mb, STAGES=cfg.stages, DP=cfg.int8_dot,
           num_warps=cfg.warps, **reg_cap(cfg.warps, cfg.ctas_per_sm))
