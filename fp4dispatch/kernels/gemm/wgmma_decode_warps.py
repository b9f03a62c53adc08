"""``wgds``: the NVFP4 GEMM for SM90 in Gluon with the decode in warps of its own (``WgmmaDecodeWarpsConfig``,
offered at 64 < M <= 128). Only imported where :func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

``wgmma_warp_specialized`` decodes the weight straight into the register operand of its wgmma, in the warps that
issue it: a lone warpgroup then alternates decode and MMA, and two consumer warpgroups pass Triton 3.6's partition
barrier together every step. Here each partition does one thing:
- two TMA warps stream, each into its own ring, the weight words with their block scales (STAGES slots) and the
  pre-decoded activation (``wgmma_register_a.predecode``; ASTAGES slots);
- PARTS partitions of BN / 16 decode warps take turns by step: they turn a slot's words into fp16 weight values
  (``gluon_tiles.dec16`` and its K order) and store them into a DSTAGES-deep ring of wgmma operand tiles in shared
  memory;
- the default warpgroup only waits and issues async wgmma with both operands in shared memory, one group in flight,
  frees a step's activation and decoded slots once its group is done, and writes the tile (``gluon_tiles.epilogue``).
Both operands are in shared memory, so no later step can overwrite an operand in flight (the two-steps-per-pass rule
of ``wgmma_warp_specialized`` does not apply). The decoded tile's stores are fenced (generic -> async proxy) before
the arrive that hands it to the wgmma; the same fence orders the word reads before their slot is freed. The scales
come by TMA too: the fence waits for the loads in flight, so scales read with plain loads one step ahead would be
waited for every step.

Where the tiles leave SMs idle, a tile's K steps can run in SPLIT parts on CTAs of their own, whose fp32 partial sums
the last part to finish adds in part order (:func:`split_epilogue`).

With programmatic dependent launch the pre-decode lets this kernel launch as soon as the kernels before it are done,
and only the activation's loader waits for the pre-decode (``gdc_wait``): the barriers' set-up and the weight's first
loads and decodes overlap it.

Rows are taken the way the scales are stored (as ``gemv.tma_warp_specialized``): a tile is R = BN / 4 rows
``i0..i0+R`` of each 32-row quarter of a 128-row group, so its scales for a step are one box of the int32 view
(g, j, 4i + q). docs/kernels.md has what the design is for and what was tried around it.

``wgmma_decode_warps_w4a16`` launches the same kernel for ``w4a16_mm`` (``W4A16``: the activations as A, the weight
decoded to their dtype; :func:`launch_gemm` serves both).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_wait  # Triton >= 3.4, as Gluon 3.6 itself

from .gluon_tiles import (dec16, epilogue, first_tile, operand_layout, raw_layout, ring_barriers, store_layout,
                          tile_offsets)
from ..gemv.tma_warp_specialized import plain, weight_descriptors
from .. import runtime, workspace
from ..config import WgmmaDecodeWarpsConfig, decode_warps_work
from ..runtime import cdiv, launch, tma_desc
from .wgmma_register_a import pdl_after_predecode, predecode
from .wgmma_register_a_w4a16 import W4A16_UNDO


@triton.constexpr_function
def scale_layout(bn: int, bkb: int, r: int = 0) -> gl.DistributedLinearLayout:
    """The layout of a step's scale bytes as [BN/R, R, BKB/4, 4] (q, i, j, b) that reshaped to [BN, BKB] (rows
    q*R + i, blocks 4j + b) is ``raw_layout`` of the words, so each thread gets its words' scales with no data
    movement. R: rows of each quarter, BN / 4 unless given (32, whole quarters: benchmarks/wgdy_kernel.py's chunks)."""
    bn, bkb, r = (getattr(v, "value", v) for v in (bn, bkb, r))
    r, raw = r or bn // 4, raw_layout(bkb, bn // 16)

    def to4(base):
        return [base[0] // r, base[0] % r, base[1] // 4, base[1] % 4]
    return gl.DistributedLinearLayout(reg_bases=[to4(b) for b in raw.reg_bases],
                                      lane_bases=[to4(b) for b in raw.lane_bases],
                                      warp_bases=[to4(b) for b in raw.warp_bases], block_bases=[],
                                      shape=[bn // r, r, bkb // 4, 4])


@gluon.jit
def _tile_rows(tile, NT, BN: gl.constexpr):
    """(g, i0) of the tile's rows: R = BN / 4 rows from i0 of each quarter of 128-row group g."""
    u = tile % NT
    return u // (128 // BN), (u % (128 // BN)) * (BN // 4)


@gluon.jit
def _unit(u, SPLIT, SPS, STEPS):
    """(tile, first K step, K steps) of work unit u: part u % SPLIT of tile u // SPLIT's K steps, SPS steps each but
    the last part's (at least one)."""
    k0 = (u % SPLIT) * SPS
    return u // SPLIT, k0, gl.minimum(SPS, STEPS - k0)


@gluon.jit
def _units(UNITS):
    """This CTA's work units [lo, hi): shared out in order (``first_tile``)."""
    return first_tile(gl.program_id(0), UNITS), first_tile(gl.program_id(0) + 1, UNITS)


@gluon.jit
def _load_w(x_desc, s_desc, w_s, s_s, wready, wempty, UNITS, NT, SPLIT, SPS, STEPS):
    """TMA loads of the weight words and scales of this CTA's units, step after step, into their ring."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    BKB: gl.constexpr = w_s.type.shape[3]
    lo, hi = _units(UNITS)
    j = 0
    for u in range(lo, hi):
        tile, k0, n = _unit(u, SPLIT, SPS, STEPS)
        g, i0 = _tile_rows(tile, NT, 4 * R)
        for ks in range(n):
            kb = (k0 + ks) * BKB
            s = j % STAGES
            mbarrier.wait(wempty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier: the first pass does not wait
            mbarrier.expect(wready.index(s), 4 * R * BKB * 9)
            tma.async_copy_global_to_shared(x_desc, [4 * g, i0, kb], wready.index(s), w_s.index(s))
            tma.async_copy_global_to_shared(s_desc, [g, kb // 4, 4 * i0], wready.index(s), s_s.index(s))
            j += 1


@gluon.jit
def _load_a(y_desc, a_s, aready, aempty, UNITS, NT, SPLIT, SPS, STEPS):
    """TMA loads of the pre-decoded activation of this CTA's units into its own ring: from L2 (every N tile reads it),
    so it needs fewer slots ahead than the weight from DRAM, and each of its slots holds about 7 weight slots' bytes
    at BM 128."""
    STAGES: gl.constexpr = a_s.type.shape[0]
    BM: gl.constexpr = a_s.type.shape[1]
    BK: gl.constexpr = a_s.type.shape[2]
    # The only wait for the kernel before (programmatic dependent launch): the activation's pre-decode, which lets
    # this kernel launch once the kernels before it are done. The other partitions read only the weight and write out
    # at the end, so barrier set-up, the weight's loads and its first decodes overlap the pre-decode. (Safe without
    # PDL: then the pre-decode is done already.)
    gdc_wait()
    lo, hi = _units(UNITS)
    j = 0
    for u in range(lo, hi):
        tile, k0, n = _unit(u, SPLIT, SPS, STEPS)
        for ks in range(n):
            s = j % STAGES
            mbarrier.wait(aempty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(aready.index(s), BM * BK * 2)
            tma.async_copy_global_to_shared(y_desc, [(tile // NT) * BM, (k0 + ks) * BK], aready.index(s),
                                            a_s.index(s))
            j += 1


@gluon.jit
def _decode(w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, PART, PARTS):
    """:func:`_decode_steps` of the NVFP4 GEMM."""
    _decode_steps(w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, PART, PARTS, False)


@gluon.jit
def _decode_w4a16(w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, PART, PARTS):
    """:func:`_decode_steps` of the W4A16 GEMM (a partition's arguments reach it as values, never as constexprs:
    each form has a partition function of its own)."""
    _decode_steps(w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, PART, PARTS, True)


@gluon.jit
def _decode_steps(w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, PART, PARTS,
                  W4A16: gl.constexpr):
    """Every PARTS-th step from PART: the slot's words and scales -> 16-bit operand tile in the step's ``d_s`` buffer
    (fp16 by the CVT decode; with W4A16 in ``d_s``'s dtype, fp16 or bf16, by the decode without CVT, whose K order
    ``wgmma_register_a_w4a16.permute_a`` gives the activations).
    Each decode partition is one dependent chain per warp (wait, read, decode, store, fence, arrive); PARTS of them
    overlap (two hide more of the chain than one). A partition is at most PARTS steps ahead of the last
    one it freed, so rings of >= PARTS slots keep every barrier within one phase of its waiters; and with STAGES a
    multiple of PARTS a weight slot always serves the same partition, which has waited for the slot's previous load
    itself (else another partition's load still in flight leaves the barrier a phase behind, and the wait passes)."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    R: gl.constexpr = w_s.type.shape[2]
    BKB: gl.constexpr = w_s.type.shape[3]
    DSTAGES: gl.constexpr = d_s.type.shape[0]
    RAW: gl.constexpr = raw_layout(BKB, R // 4)
    SL: gl.constexpr = scale_layout(4 * R, BKB)
    words = w_s._reinterpret(gl.int64, [STAGES, 4 * R, BKB], plain(2))
    scales = s_s._reinterpret(gl.uint8, [STAGES, BKB // 4, R, 4, 4], plain(4))  # (j, i, q, b)
    lo, hi = _units(UNITS)
    total = 0
    for u in range(lo, hi):
        total += _unit(u, SPLIT, SPS, STEPS)[2]
    for it in range(PART, total, PARTS):
        s = it % STAGES
        d = it % DSTAGES
        mbarrier.wait(wready.index(s), (it // STAGES) & 1)
        sc = gl.reshape(scales.index(s).permute((2, 1, 0, 3)).load(SL), [4 * R, BKB])
        sc = gl.convert_layout(sc, RAW, assert_trivial=True)
        if W4A16:
            w = dec16(words.index(s).load(RAW), sc, BKB, True, False, d_s.dtype == gl.bfloat16)
        else:
            w = dec16(words.index(s).load(RAW), sc, BKB, True, True)
        mbarrier.wait(dempty.index(d), ((it // DSTAGES) & 1) ^ 1)
        d_s.index(d).store(w)
        fence_async_shared()  # also completes the word and scale reads before the slot is freed
        mbarrier.arrive(dready.index(d))
        mbarrier.arrive(wempty.index(s))


@triton.constexpr_function
def sum_layout(bm: int, warps: int) -> gl.BlockedLayout:
    """The layout in which :func:`split_epilogue` reads a chunk of partial sums: 16 contiguous bytes per thread
    along a row of the [BN, BM] tile."""
    bm, warps = getattr(bm, "value", bm), getattr(warps, "value", warps)
    t1 = min(bm // 4, 32)
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // t1, t1], warps_per_cta=[warps, 1],
                            order=[1, 0])


@gluon.jit
def split_epilogue(acc, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, tile, part, SPLIT, n0, m0, M, N, QR: gl.constexpr,
                   UNDO: gl.constexpr):
    """Part ``part`` of a tile's SPLIT partial sums, by ``tiles.reduce_store``'s protocol: stored in fp32, straight
    from the wgmma layout, to the tile's own [BN, BM] block of ws (block tile * SPLIT + part: a thread writes whole
    32-byte sectors); the CTA that counts itself in last on cnt_ptr[tile] sums the blocks in part order (the result
    does not depend on arrival order), 32 rows at a time with 16-byte reads, four parts' reads in flight at once,
    applies alpha (and ``epilogue``'s UNDO), writes out (``epilogue``'s rows, QR) and sets the counter back to zero.
    The partials stay in the wgmma layout and are read 16 bytes and four parts at a time: stored in out's layout and
    read back one part at a time, 4 bytes per read, the sum costs several times more per part."""
    BN: gl.constexpr = acc.type.shape[0]
    BM: gl.constexpr = acc.type.shape[1]
    L: gl.constexpr = acc.type.layout
    CH: gl.constexpr = 32 if BN > 32 else BN
    GROUP: gl.constexpr = 4
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, BM, layout=gl.SliceLayout(0, L))
    block = ws_ptr + (tile * SPLIT).to(gl.int64) * (BN * BM)  # int64: tiles * SPLIT * BN * BM may pass 2**31
    gl.store(block + part * (BN * BM) + (r[:, None] * BM + c[None, :]), acc)
    # the barrier orders every thread's partial before the count; the atomic's release publishes them to the GPU,
    # its acquire makes the other parts' visible to the last
    gl.thread_barrier()
    one = tile * 0 + 1  # (Gluon 3.6's atomics take tensors, not Python ints)
    if gl.atomic_add(cnt_ptr + tile, one, sem="acq_rel", scope="gpu") == SPLIT - 1:
        LD: gl.constexpr = sum_layout(BM, gl.num_warps())
        ST: gl.constexpr = store_layout(CH, BM, False, gl.num_warps())
        rr = gl.arange(0, CH, layout=gl.SliceLayout(1, LD))
        cc = gl.arange(0, BM, layout=gl.SliceLayout(0, LD))
        scale = UNDO * gl.load(alpha_ptr)
        for r0 in gl.static_range(0, BN, CH):
            chunk = block + (r0 + rr[:, None]) * BM + cc[None, :]
            total = gl.zeros([CH, BM], gl.float32, LD)
            # GROUP parts' loads in flight at once (unrolled, past SPLIT masked off), still added in part order;
            # .cg: from L2, where the other SMs' partials are
            for p0 in range(0, SPLIT, GROUP):
                for i in gl.static_range(GROUP):
                    total += gl.load(chunk + (p0 + i) * (BN * BM), mask=p0 + i < SPLIT, other=0.0,
                                     cache_modifier=".cg")
            corner, offs, mask = tile_offsets(n0, m0, M, N, CH, BM, ST, False, QR, r0)
            gl.store(out_ptr + corner + offs, gl.convert_layout((total * scale).to(out_ptr.dtype.element_ty), ST),
                     mask=mask)
        gl.atomic_xchg(cnt_ptr + tile, one - 1, sem="relaxed", scope="gpu")


@gluon.jit
def _mma(d_s, a_s, aready, aempty, dready, dempty, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, UNITS, NT, SPLIT, SPS,
         STEPS, UNDO: gl.constexpr):
    """For each unit: acc [BN, BM] = W @ A.T over its K steps with one wgmma group in flight; a step's two operand
    buffers are freed once its group is done; then the epilogue, or with SPLIT > 1 ``split_epilogue`` (the other
    partitions run on into the next unit). Two groups in flight would need rings one slot deeper, which leaves less
    shared memory for the rings that bound the kernel."""
    STAGES: gl.constexpr = a_s.type.shape[0]
    BM: gl.constexpr = a_s.type.shape[1]
    DSTAGES: gl.constexpr = d_s.type.shape[0]
    BN: gl.constexpr = d_s.type.shape[1]
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    lo, hi = _units(UNITS)
    it = 0
    for u in range(lo, hi):
        tile, k0, n = _unit(u, SPLIT, SPS, STEPS)
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        for ks in range(n):
            mbarrier.wait(aready.index(it % STAGES), (it // STAGES) & 1)
            mbarrier.wait(dready.index(it % DSTAGES), (it // DSTAGES) & 1)
            acc = warpgroup_mma(d_s.index(it % DSTAGES), a_s.index(it % STAGES).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            mbarrier.arrive(aempty.index((it + STAGES - 1) % STAGES), pred=ks > 0)  # step it - 1 is done
            mbarrier.arrive(dempty.index((it + DSTAGES - 1) % DSTAGES), pred=ks > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(aempty.index((it + STAGES - 1) % STAGES))
        mbarrier.arrive(dempty.index((it + DSTAGES - 1) % DSTAGES))
        g, i0 = _tile_rows(tile, NT, BN)
        if SPLIT > 1:
            split_epilogue(acc, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, tile, u % SPLIT, SPLIT, g * 128 + i0,
                           (tile // NT) * BM, M, N, BN // 4, UNDO)
        else:
            epilogue(acc, alpha_ptr, out_ptr, g * 128 + i0, (tile // NT) * BM, M, N, False, BN // 4, UNDO)


# SPLIT is never a constexpr: a launch specializes an int equal to 1 to one, and Triton 3.6 then fails to lower the
# split epilogue it still emits under a constant-false branch (an assertion in ConvertTritonGPUToLLVM)
@gluon.jit(do_not_specialize=["SPLIT"])
def wgds_kernel(x_desc, s_desc, y_desc, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, NT, UNITS, SPLIT, SPS, STEPS,
                BN: gl.constexpr, BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, ASTAGES: gl.constexpr,
                DSTAGES: gl.constexpr, DREGS: gl.constexpr, PARTS: gl.constexpr, W4A16: gl.constexpr = False,
                UNDO: gl.constexpr = 0.25):
    """out [M, N] = alpha * A @ W.T over tiles [BN, BM] (NT along N) of STEPS K steps of BKB 16-blocks, each cut into
    SPLIT parts of SPS steps (``_unit``; partial sums: ``split_epilogue``, workspace ``ws_ptr``, counters ``cnt_ptr``);
    the UNITS parts shared out in order (``first_tile``): W's words and block scales by ``x_desc`` and ``s_desc``
    (views: :func:`launch_gemm`) into a ring of STAGES slots, A pre-decoded by ``y_desc`` into one of ASTAGES, W
    decoded into one of DSTAGES.
    W4A16: A is the 16-bit activations in the weight decode's K order (``y_desc``'s dtype, fp16 or bf16) instead;
    UNDO: the epilogue's power of two (``epilogue``).
    Partitions: the MMA warpgroup (default), a TMA warp per ring, PARTS (1 or 2) partitions of BN / 16 decode warps
    of DREGS registers taking turns by step."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, 4, BN // 4, BKB], x_desc.layout)
    s_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BKB // 4, BN], s_desc.layout)
    a_s = gl.allocate_shared_memory(y_desc.dtype, [ASTAGES, BM, BKB * 16], y_desc.layout)
    d_s = gl.allocate_shared_memory(y_desc.dtype, [DSTAGES, BN, BKB * 16],
                                    gl.NVMMASharedLayout.get_default_for([BN, BKB * 16], y_desc.dtype))
    wready, wempty = ring_barriers(STAGES)
    aready, aempty = ring_barriers(ASTAGES)
    dready, dempty = ring_barriers(DSTAGES)
    # (the partitions' functions are spelled out per branch: jit code cannot hold a function in a tuple variable)
    mma = (d_s, a_s, aready, aempty, dready, dempty, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, UNITS, NT, SPLIT, SPS,
           STEPS, UNDO)
    load_w = (x_desc, s_desc, w_s, s_s, wready, wempty, UNITS, NT, SPLIT, SPS, STEPS)
    load_a = (y_desc, a_s, aready, aempty, UNITS, NT, SPLIT, SPS, STEPS)
    dec0 = (w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, 0, PARTS)
    dec1 = (w_s, s_s, d_s, wready, wempty, dready, dempty, UNITS, SPLIT, SPS, STEPS, 1, PARTS)
    if W4A16:
        if PARTS == 1:
            gl.warp_specialize([(_mma, mma), (_load_w, load_w), (_load_a, load_a), (_decode_w4a16, dec0)],
                               [1, 1, BN // 16], [40, 40, DREGS])
        else:
            gl.warp_specialize([(_mma, mma), (_load_w, load_w), (_load_a, load_a), (_decode_w4a16, dec0),
                                (_decode_w4a16, dec1)], [1, 1, BN // 16, BN // 16], [40, 40, DREGS, DREGS])
    elif PARTS == 1:
        gl.warp_specialize([(_mma, mma), (_load_w, load_w), (_load_a, load_a), (_decode, dec0)],
                           [1, 1, BN // 16], [40, 40, DREGS])
    else:
        gl.warp_specialize([(_mma, mma), (_load_w, load_w), (_load_a, load_a), (_decode, dec0), (_decode, dec1)],
                           [1, 1, BN // 16, BN // 16], [40, 40, DREGS, DREGS])


def split_buffers(parts: int, tiles: int, block: int, alpha: torch.Tensor, out: torch.Tensor) -> tuple:
    """(workspace, counters) of the split K (:func:`split_epilogue`: a ``block``-element fp32 block per (tile,
    part)). Typed as for a split launch even when ``parts`` is 1: SPLIT is a runtime value (``do_not_specialize``),
    so the split epilogue is compiled whatever it is, and its atomics need int32 counters; the 1-element alpha stands
    in for both, never read or written."""
    if parts == 1:
        return alpha, alpha.view(torch.int32)
    return workspace.buffers(tiles, block, parts, tiles, out.device)


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaDecodeWarpsConfig) -> None:
    """Decode the activation once (``predecode``), then :func:`launch_gemm`."""
    check_operands("fp4_mm", "configs_for", b, sb, cfg)
    pre, opts = pdl_after_predecode(runtime.pdl(out.device, cfg.pdl))
    launch_gemm(predecode(a.view(torch.int64), sa, True, CVT=True, **pre), b, sb, alpha, out, cfg, opts)


def check_operands(op: str, source: str, b: torch.Tensor, sb: torch.Tensor, cfg: WgmmaDecodeWarpsConfig) -> None:
    """What ``wgds_kernel``'s TMA boxes need of the weight (before anything is launched); ``op`` and ``source`` (the
    heuristics function that offers its configs) name it in the error."""
    n, kb = b.shape[0], b.shape[1] // 8
    if n % 32 or kb % 2 or b.data_ptr() % 16 or sb.data_ptr() % 16:
        raise ValueError(f"{op}: {type(cfg).__name__} needs N % 32 == 0, K % 32 == 0 and a 16-byte aligned b and "
                         f"b_scale; got N={n}, K={kb * 16}, data_ptr() % 16 of (b, b_scale) = "
                         f"{(b.data_ptr() % 16, sb.data_ptr() % 16)}. Use another config from {source}()")


def launch_gemm(ad: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
                cfg: WgmmaDecodeWarpsConfig, opts: dict, w4a16: bool = False) -> None:
    """Launch ``wgds_kernel`` on the 16-bit A operand ``ad`` [M, >= K] already in the weight decode's K order (the
    pre-decoded NVFP4 activation, or with ``w4a16`` the permuted activations) and the weight's words and scales as
    ``gemv.tma_warp_specialized.weight_descriptors`` views them (block_n / 4 rows of each quarter, k_blocks blocks):
    one CTA per (tile, K part), or with ``persistent`` one per SM. ``opts``: launch options (PDL)."""
    m, n, kb = ad.shape[0], b.shape[0], b.shape[1] // 8
    bm, bn, bkb = cfg.block_m, cfg.block_n, cfg.k_blocks
    x_desc, s_desc = weight_descriptors(b, sb, bn // 4, bkb)
    y_layout = operand_layout(bm, bkb, ad.dtype)
    y_desc = tma_desc(ad.data_ptr(), ad.dtype, tuple(ad.shape), ad.stride(), (bm, bkb * 16), y_layout)
    nt, tiles, steps = decode_warps_work(m, n, kb, cfg)
    sps = cdiv(steps, max(1, min(cfg.split_k, steps)))
    split = cdiv(steps, sps)  # every part gets >= 1 step
    ws, cnt = split_buffers(split, tiles, bn * bm, alpha, out)
    units = tiles * split
    form = {"W4A16": True, "UNDO": W4A16_UNDO.value} if w4a16 else {}  # the NVFP4 GEMM: the kernel's defaults
    launch(wgds_kernel, (min(units, runtime.num_sms(out.device)) if cfg.persistent else units,), x_desc, s_desc,
           y_desc, alpha, out, ws, cnt, m, n, nt, units, split, sps, steps, BN=bn, BM=bm, BKB=bkb, STAGES=cfg.stages,
           ASTAGES=cfg.act_stages, DSTAGES=cfg.decoded_stages, DREGS=cfg.decode_registers,
           PARTS=cfg.decode_partitions, num_warps=4, **opts, **form)

