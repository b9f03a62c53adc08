"""``wgws``: the warp-specialized NVFP4 GEMM for SM90 in Gluon (``WgmmaWarpSpecializedConfig``, offered for
M > 128). Only imported where :func:`~fp4dispatch.kernels.target.gluon_missing` says it can be.

``acc[BN, BM] = W @ A.T``, as ``wgmma_register_a``, but without Triton's pipeliner:
- a producer warp streams the weight words and the pre-decoded activation (``wgmma_register_a.predecode``) by TMA
  into a STAGES-deep shared-memory ring (``ready`` mbarriers, one per slot; zero-filled past N, M and K);
- the default partition (a warpgroup per 64 weight rows) waits for a slot, decodes the words straight into the
  register operand of an async wgmma (``gluon_tiles.dec16``, through the e4m3x2 conversion; the convert to the
  operand layout is free in ``raw_layout``), leaves one wgmma group in flight while it decodes the next step, and
  frees the slot whose group is done (``empty`` mbarriers);
- the epilogue applies alpha in fp32 and stores through ``store_layout`` (rows of out along n).
A CTA runs a range of whole tiles (``first_tile``), so a grid of one CTA per SM is persistent (the producer loads the
next tile while the consumers finish one). With SWAP the operands change roles: the activation is decoded in
registers, the weight pre-decoded, out = acc instead of acc.T, which decodes fewer values where M > N. Launched with
PDL after the pre-decode, whose CTAs let it launch once the kernels before are done; only the producer waits for the
pre-decode (``gdc_wait``).

Two things a correct version needs:
- the consumer loop runs two K steps per pass. A rolled loop decodes every step into the same registers, and with
  a group in flight the decode overwrites the operand that group is still reading (wrong results at BM 256);
  unrolled, each step's operand is its own value and ptxas gives it its own registers (tests/test_gluon_sass.py
  checks the SASS);
- the epilogue moves the tile into ``store_layout`` first: stored from the wgmma layout, each thread writes 2-byte
  values N apart, thousands of instructions with register spills per tile.
docs/kernels.md has what the design is for and what was tried around it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_wait  # Triton >= 3.4, as Gluon 3.6 itself

from .. import runtime
from ..config import WgmmaWarpSpecializedConfig
from ..runtime import cdiv, launch, tma_desc
from .gluon_tiles import (epilogue, first_tile, load_scales, mma_step, operand_layout, raw_layout, ring_barriers,
                          scale_ptrs, word_tile_layout)
from .wgmma_register_a import pdl_after_predecode, predecode
from .wgmma_register_a_w4a16 import W4A16_UNDO


@gluon.jit
def _producer(b_desc, a_desc, w_s, a_s, ready, empty, TILES, NT, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring: it runs on into the next tile while the
    consumers finish one."""
    # (Triton 3.6 passes a worker partition's constexpr arguments as i32 values: sizes come from the buffers' types)
    STAGES: gl.constexpr = w_s.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    NBYTES: gl.constexpr = BN * BKB * 8 + BM * BKB * 32
    # The kernel's one wait for the kernel before (programmatic dependent launch): the pre-decode, which lets this
    # kernel launch once the kernels before it are done; the consumers read only inputs from before that and wait
    # for the ring. (Safe without PDL: then the pre-decode is done already.)
    gdc_wait()
    lo = first_tile(gl.program_id(0), TILES)
    for j in range((first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
        tile = lo + j // STEPS
        ks = j % STEPS
        s = j % STAGES
        # a fresh barrier counts as having finished the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), NBYTES)
        tma.async_copy_global_to_shared(b_desc, [(tile % NT) * BN, ks * BKB], ready.index(s), w_s.index(s))
        tma.async_copy_global_to_shared(a_desc, [(tile // NT) * BM, ks * BKB * 16], ready.index(s), a_s.index(s))


@gluon.jit
def _release(w_s, a_s, ready, empty, it, prev, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr, W4A16: gl.constexpr):
    """Ring step ``it``: decode and issue its wgmma, wait until one group is left in flight, then free the slot of
    step it - 1 (``prev``: it is this tile's), whose group is done. No proxy fence: the words were read into
    registers before that group was issued (CUTLASS's TMA pipeline releases the same way), and a fence here
    compiles to MEMBAR.ALL.CTA."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    acc = mma_step(w_s, a_s, ready, it, sb, acc, RAW, DOT, W4A16)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=prev)
    return acc


@gluon.jit
def _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS,
             SWAP: gl.constexpr, W4A16: gl.constexpr):
    """For each of this CTA's tiles: acc [BN, BM] = X @ Y.T (a warpgroup per 64 of the BN = 16 * num_warps rows),
    then the epilogue (W4A16: ``mma_step``'s decode without CVT, undone by 2**7)."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BN: gl.constexpr = w_s.type.shape[1]
    BKB: gl.constexpr = w_s.type.shape[2]
    BM: gl.constexpr = a_s.type.shape[1]
    RAW: gl.constexpr = raw_layout(BKB, BN // 16)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BN // 16, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    lo = first_tile(gl.program_id(0), TILES)
    for tile in range(lo, first_tile(gl.program_id(0) + 1, TILES)):
        j = (tile - lo) * STEPS  # the ring step of the tile's first K step
        n0 = (tile % NT) * BN
        m0 = (tile // NT) * BM
        sptr, smask, t = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
        sb0 = load_scales(sptr, smask, t, 0, KB)
        sb1 = load_scales(sptr, smask, t, BKB, KB)
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        # Two steps per pass, so that two values hold the decoded operands: a step's decode runs while the step
        # before's wgmma still reads its register operand. In a rolled loop both are one value, the same registers.
        # A step's scale bytes are loaded two steps ahead: loaded one step ahead, the consumers wait for them.
        for i in range(STEPS // 2):
            sb2 = load_scales(sptr, smask, t, (2 * i + 2) * BKB, KB)
            acc = _release(w_s, a_s, ready, empty, j + 2 * i, i > 0, sb0, acc, RAW, DOT, W4A16)
            sb3 = load_scales(sptr, smask, t, (2 * i + 3) * BKB, KB)
            acc = _release(w_s, a_s, ready, empty, j + 2 * i + 1, True, sb1, acc, RAW, DOT, W4A16)
            sb0 = sb2
            sb1 = sb3
        if STEPS % 2 == 1:
            acc = _release(w_s, a_s, ready, empty, j + STEPS - 1, STEPS > 1, sb0, acc, RAW, DOT, W4A16)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((j + STEPS - 1) % STAGES))  # the tile's last slot: the producer runs on
        if W4A16:
            epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP, UNDO=W4A16_UNDO)
        else:
            epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP)


# SWAP and W4A16 by wrapper: Triton 3.6 passes a partition's constexpr arguments as i32 values, so the default
# partition is one of three functions that each call _consume with literals
@gluon.jit
def _consume_out(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, False, False)


@gluon.jit
def _consume_swap(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, True, False)


@gluon.jit
def _consume_w4a16(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(w_s, a_s, ready, empty, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, False, True)


@gluon.jit
def wgws_kernel(x_desc, y_desc, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, NT, TILES, STEPS, BN: gl.constexpr,
                BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, SWAP: gl.constexpr,
                W4A16: gl.constexpr = False):
    """acc [BN, BM] = X @ Y.T tiles: X the N rows of NVFP4 words (``x_desc``, block scales ``sx_ptr``), decoded in
    registers; Y the M rows pre-decoded to fp16 (``y_desc``). out [M, N] = acc.T (X the weight), or with SWAP out
    [N, M] = acc (X the activation). The TILES tiles (NT along N) of STEPS K steps each are shared out in order
    (``first_tile``): a grid of TILES CTAs is the plain tiled kernel, a smaller one persistent (the loads run on
    across tile ends). The default partition (num_warps = BN / 16) consumes, a worker warp loads.
    W4A16: Y is the 16-bit activations in the weight decode's K order (``y_desc``'s dtype, fp16 or bf16; no SWAP)."""
    w_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], x_desc.layout)
    a_s = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BM, BKB * 16], y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    args = (w_s, a_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS)
    load = (x_desc, y_desc, w_s, a_s, ready, empty, TILES, NT, STEPS)
    if W4A16:
        gl.warp_specialize([(_consume_w4a16, args), (_producer, load)], [1], [40])
    elif SWAP:
        gl.warp_specialize([(_consume_swap, args), (_producer, load)], [1], [40])
    else:
        gl.warp_specialize([(_consume_out, args), (_producer, load)], [1], [40])



def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
        cfg: WgmmaWarpSpecializedConfig) -> None:
    """One operand decoded once to fp16 (``predecode``), then :func:`launch_gemm`. The decoded one is A, or with
    ``swap`` the weight (out = A @ W.T tile by tile: fewer values to decode where M > N)."""
    x, sx, y, sy = (a, sa, b, sb) if cfg.swap else (b, sb, a, sa)  # x: decoded in registers, y: decoded first
    check_operand("fp4_mm", "configs_for", "a" if cfg.swap else "b", x, cfg)
    # with PDL only the producer waits for the pre-decode
    pre, opts = pdl_after_predecode(runtime.pdl(out.device, cfg.pdl))
    launch_gemm(x, sx, predecode(y.view(torch.int64), sy, True, CVT=True, **pre), alpha, out, cfg, opts)


def check_operand(op: str, source: str, name: str, x: torch.Tensor, cfg: WgmmaWarpSpecializedConfig) -> None:
    """What the TMA box of the operand decoded in registers (``name`` of ``op``) needs, before anything is
    launched; ``source``: the heuristics function that offers the configs, named in the error."""
    kb = x.shape[1] // 8
    if kb % 2 or x.data_ptr() % 16:  # TMA: 16-byte aligned base and row stride
        raise ValueError(f"{op}: {type(cfg).__name__} needs K % 32 == 0 and a 16-byte aligned {name}; got "
                         f"K={kb * 16}, data_ptr() % 16 = {x.data_ptr() % 16}. Use another config from {source}()")


def launch_gemm(x: torch.Tensor, sx: torch.Tensor, yd: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor,
                cfg: WgmmaWarpSpecializedConfig, opts: dict, w4a16: bool = False) -> None:
    """One launch of ``wgws_kernel`` over TMA descriptors of x's words (uint8 [rows, K/2], decoded in registers with
    block scales ``sx``) and yd (16-bit [rows, >= K] in the decode's K order: the pre-decoded NVFP4 operand, or with
    ``w4a16`` the permuted activations). ``opts``: launch options (PDL)."""
    kb = x.shape[1] // 8
    nx, ny = x.shape[0], yd.shape[0]
    bm, bn, bkb = cfg.block_m, cfg.block_n, cfg.k_blocks
    x_desc = tma_desc(x.data_ptr(), torch.int64, (nx, kb), (kb, 1), (bn, bkb), word_tile_layout(bn, bkb))
    y_desc = tma_desc(yd.data_ptr(), yd.dtype, tuple(yd.shape), yd.stride(), (bm, bkb * 16),
                      operand_layout(bm, bkb, yd.dtype))
    nt, steps = cdiv(nx, bn), cdiv(kb, bkb)
    tiles = nt * cdiv(ny, bm)
    # persistent: one CTA per SM (the ring fills its shared memory), whole tiles each, so that the loads run on
    # across a tile's epilogue; else one CTA per tile
    ctas = min(tiles, runtime.num_sms(out.device)) if cfg.persistent else tiles
    form = {"W4A16": True} if w4a16 else {}  # the NVFP4 GEMM: the kernel's default
    launch(wgws_kernel, (ctas,), x_desc, y_desc, sx, alpha, out, ny, nx, kb, cdiv(kb, 4), nt, tiles, steps, BN=bn,
           BM=bm, BKB=bkb, STAGES=cfg.stages, SWAP=cfg.swap, num_warps=bn // 16, **opts, **form)
