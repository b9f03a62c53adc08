"""Tile bookkeeping shared by the Triton kernels (``@triton.jit``): grid to tile, the output tile's offsets, the
epilogue (alpha in fp32, the cast to out's dtype) with its split-K reduction, the stream-K schedule, and the PDL
wait.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # griddepcontrol (programmatic dependent launch, SM90+); Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: the host never sets PDL
    gdc_wait = gdc_launch_dependents = None
HAS_GDC = gdc_wait is not None


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL) a kernel may start while the previous one on its stream is still
    running; nothing may touch memory before this wait (the previous kernel's writes are visible after it). Only the
    A-decode kernel before the Gluon GEMMs triggers its dependents early (``wmma_prep_a_kernel``'s EARLY): an early
    trigger before ``wmma_kernel`` lets its CTAs be placed unevenly, which costs more than the launch it hides."""
    if PDL:
        gdc_wait()


@triton.jit
def cast_store(acc, offs, omask, alpha_ptr, out_ptr):
    acc = acc * tl.load(alpha_ptr)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def out_tile(rm, rn, M, N):
    """Offsets (int64) and mask of the output tile [rows rm, columns rn] of an [M, N] matrix."""
    return rm[:, None].to(tl.int64) * N + rn[None, :], (rm[:, None] < M) & (rn[None, :] < N)


@triton.jit
def store_out(acc, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT: tl.constexpr):
    """Epilogue of every fused kernel: alpha in fp32 and the cast to out's dtype.

    SPLIT (split-K over program_id(1), no extra launches): each CTA stores its fp32 partial tile to the workspace
    ws [splits, M, N] and counts itself in on its tile's counter, see ``reduce_store``."""
    offs, omask = out_tile(rm, rn, M, N)
    if SPLIT:
        tile = tl.program_id(0) + tl.program_id(2) * tl.num_programs(0)
        reduce_store(acc, offs, omask, M, N, tl.program_id(1), tl.num_programs(1), tile, alpha_ptr, out_ptr, ws_ptr,
                     cnt_ptr)
    else:
        cast_store(acc, offs, omask, alpha_ptr, out_ptr)


@triton.jit
def reduce_store(acc, offs, omask, M, N, part, parts, tile, alpha_ptr, out_ptr, ws_ptr, cnt_ptr):
    """One of ``parts`` partial sums of a tile: stored to ws [part, M, N]; the tile's counter (cnt_ptr[tile], int32,
    zero on entry) counts the arrivals, and the CTA that arrives last sums the partials in part order (so the result
    does not depend on arrival order), writes out and sets the counter back to zero for the next launch, which is
    what lets the host zero the counters only once."""
    mn = (tile * 0).to(tl.int64) + M  # int64 before the product: parts * M * N may pass 2**31
    mn = mn * N
    tl.store(ws_ptr + part * mn + offs, acc, mask=omask)
    # every thread's partial stores come before the count: the barrier orders them within the CTA, the atomic's
    # release publishes them to the GPU, its acquire makes the others' partials visible to the last
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:
        total = tl.zeros_like(acc)
        for s in range(0, parts):
            # .cg: read from L2, where the other SMs' partials are (never a stale L1 line)
            total += tl.load(ws_ptr + s * mn + offs, mask=omask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        cast_store(total, offs, omask, alpha_ptr, out_ptr)


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid`` of a 1-D grid over [M, N] tiles -> its (M tile, N tile), M tiles taken GROUP_M at a time
    down each N column so that a group's CTAs share weight tiles in L2."""
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def grid_tile(BN: tl.constexpr, BM: tl.constexpr, BKB: tl.constexpr):
    """Program ids of an (N tile, K split, M tile) grid -> (K split, N rows, M rows, block offsets of one K step)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(2) * BM + tl.arange(0, BM)
    return tl.program_id(1), rn, rm, tl.arange(0, BKB)


# Stream-K (``wgmma_register_a``'s and its W4A16 form's): the K steps of all TILES tiles (NT along N; STEPS per tile),
# laid end to end, are cut into one equal range per CTA, so every CTA does the same work whatever the tile count (no
# partial last wave). A CTA runs the tile pieces of its range in order; a tile cut between CTAs is summed by its last
# CTA to arrive (``reduce_store``, pieces in CTA order: deterministic). A kernel:
#     c, p, total, it, hi = stream_range(TILES, STEPS)
#     while it < hi:
#         tile, start, s0, s1, rn, rm = stream_piece(it, hi, STEPS, NT, BN, BM)
#         acc = <the tile [BM, BN] over K steps [s0, s1)>
#         stream_store(acc, tile, start, STEPS, total, c, p, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr)
#         it = start + s1
@triton.jit
def stream_range(TILES, STEPS):
    """(this CTA, CTAs, all steps, this CTA's first step, the step past its last)."""
    c = tl.program_id(0)
    p = tl.num_programs(0)
    total = TILES.to(tl.int64) * STEPS  # int64: step indices times the CTA count may pass 2**31
    return c, p, total, (c * total) // p, ((c + 1) * total) // p


@triton.jit
def stream_piece(it, hi, STEPS, NT, BN: tl.constexpr, BM: tl.constexpr):
    """The piece that starts at step ``it`` and ends at ``hi`` or at its tile's end: (tile, the tile's first step,
    the tile's steps [s0, s1) in it, its N rows, its M rows)."""
    tile = (it // STEPS).to(tl.int32)
    start = tile.to(tl.int64) * STEPS
    s0 = (it - start).to(tl.int32)
    s1 = tl.minimum(STEPS, s0 + (hi - it).to(tl.int32))
    return tile, start, s0, s1, (tile % NT) * BN + tl.arange(0, BN), (tile // NT) * BM + tl.arange(0, BM)


@triton.jit
def stream_store(acc, tile, start, STEPS, total, c, p, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr):
    """Store a piece's [BM, BN] sum: straight to out when one CTA holds the whole tile, else as the partial of the
    c-th CTA of those that hold it (CTA c starts at step c * total // p)."""
    first = (((start + 1) * p - 1) // total).to(tl.int32)
    last = (((start + STEPS) * p - 1) // total).to(tl.int32)
    offs, omask = out_tile(rm, rn, M, N)
    if first == last:
        cast_store(acc, offs, omask, alpha_ptr, out_ptr)
    else:
        reduce_store(acc, offs, omask, M, N, c - first, last - first + 1, tile, alpha_ptr, out_ptr, ws_ptr, cnt_ptr)


@triton.jit
def k_part(pid_k, blocks_per_split, KB, BKB: tl.constexpr):
    """16-blocks [lo, hi) of split-K part ``pid_k``. ``runtime.k_split`` cuts K into whole steps of BKB blocks, so the
    part length is a multiple of BKB; written as a product with BKB, that reaches the compiler. Triton specializes an
    integer argument on divisibility by 16 only, and a part length it cannot divide makes the loop's bound masks vary
    within a vector: the weight loads then lose their 16-byte width and the scale loads their pipelining
    (tests/test_triton_sass.py)."""
    per = (blocks_per_split // BKB) * BKB  # exact
    lo = pid_k * per
    return lo, tl.minimum(lo + per, KB)
