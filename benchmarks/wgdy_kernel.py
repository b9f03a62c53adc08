"""``wgdy``: ``wgws`` (``fp4dispatch/kernels/_gluon.py``) without its pre-decode, the operand it reads decoded by its
consumers (issue 8, sixteenth session; measured slower everywhere, so it stays a benchmark: benchmarks/wgdy.py,
notes_hopper.md v20).

``wgws`` decodes one operand (X) straight into the register operand of its wgmma and reads the other (Y) pre-decoded
to fp16 by a kernel before it (``fused.predecode``). On the small shapes at M >= 1024 that costs twice (H200,
fifteenth session, notes_hopper.md v19): the pre-decode runs serially before the GEMM (4-8 us, 9-13 % of a call at
M = 1024), and a 128x256 step reads 36 KB from L2, 32 of it the fp16 Y tile. Here Y comes as NVFP4 words and block
scales (9 KB a step at 128x256):
- a TMA warp streams X's words, Y's words and Y's scales (BM / 128 groups of the int32 view (g, j, 4i + q) of the
  swizzled scale bytes, ``_gvws``'s) into one STAGES-deep ring;
- the consumers (a warpgroup per 64 X rows) decode the Y slot into one of three fp16 tiles in shared memory (16 rows
  per warp at a time, ``_dec16``: the same decode and K order as X's), fence it, decode X into registers, pass one
  barrier and issue the async wgmma; two steps per pass, for ``_gluon``'s reason.
Decode warps of their own (as ``_wgds``) did not compile at BM 256: Triton 3.6 gives every partition the same
``.maxnreg`` (64K / the CTA's threads, rounded up to whole warpgroups), 96 with two partitions of 4 decode warps,
and the 64x256 wgmma needs >= 158 (ptxas C7602).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from fp4dispatch.kernels._gluon import _dec16, _first_tile, epilogue, layouts, load_scales, raw_layout, scale_ptrs
from fp4dispatch.kernels._gvws import _layouts, plain
from fp4dispatch.kernels._wgds import _barriers, scale_layout
from fp4dispatch.kernels.launch import launch, tma_desc


@gluon.jit
def _producer(x_desc, y_desc, ys_desc, x_s, y_s, ys_s, ready, empty, TILES, NT, STEPS):
    """TMA loads of this CTA's tiles, step after step, into the ring: X's words ([BN, BKB] int64), Y's words
    ([BM, BKB]) and Y's scales (BM / 128 groups of the int32 view) in one slot; it runs on into the next tile while the
    consumers finish one."""
    STAGES: gl.constexpr = x_s.type.shape[0]
    BN: gl.constexpr = x_s.type.shape[1]
    BKB: gl.constexpr = x_s.type.shape[2]
    BM: gl.constexpr = y_s.type.shape[1]
    lo = _first_tile(gl.program_id(0), TILES)
    for j in range((_first_tile(gl.program_id(0) + 1, TILES) - lo) * STEPS):
        tile = lo + j // STEPS
        ks = j % STEPS
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier: the first pass does not wait
        mbarrier.expect(ready.index(s), (BN + BM) * BKB * 8 + BM * BKB)
        tma.async_copy_global_to_shared(x_desc, [(tile % NT) * BN, ks * BKB], ready.index(s), x_s.index(s))
        tma.async_copy_global_to_shared(y_desc, [(tile // NT) * BM, ks * BKB], ready.index(s), y_s.index(s))
        tma.async_copy_global_to_shared(ys_desc, [(tile // NT) * (BM // 128), ks * (BKB // 4), 0], ready.index(s),
                                        ys_s.index(s))


@gluon.jit
def _step(x_s, y_s, ys_s, d_s, ready, empty, it, prev, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr):
    """Ring step ``it``: decode Y's words and scales into the decoded tile ``it % 3`` (16 rows per warp at a time),
    then X's words into the register operand; one barrier for both warpgroups, then the async wgmma; once one group is
    left in flight free the slot of step it - 1 (``prev``: it is this tile's).
    Three decoded tiles make the one barrier enough: tile it % 3 was last read by wgmma it - 3, which each warpgroup
    waited for (one group left in flight after issuing it - 2) before it passed step it - 1's barrier."""
    STAGES: gl.constexpr = x_s.type.shape[0]
    BKB: gl.constexpr = x_s.type.shape[2]
    BM: gl.constexpr = y_s.type.shape[1]
    G: gl.constexpr = BM // 128
    CH: gl.constexpr = 16 * gl.num_warps()  # Y rows decoded at a time: 16 per warp
    YRAW: gl.constexpr = raw_layout(BKB, gl.num_warps())
    SL: gl.constexpr = scale_layout(CH, BKB, 32)
    scales = ys_s._reinterpret(gl.uint8, [STAGES * G, BKB // 4, 32, 4, 4], plain(4))  # (slot group, j, i, q, b)
    s = it % STAGES
    d = d_s.index(it % 3)
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    for c in gl.static_range(BM // CH):
        sc = scales.index(s * G + (c * CH) // 128)
        if CH < 128:  # the chunk's quarters of its 128-row group
            sc = sc.slice(((c * CH) % 128) // 32, CH // 32, dim=2)
        sc = gl.reshape(sc.permute((2, 1, 0, 3)).load(SL), [CH, BKB])  # rows q * 32 + i
        yv = _dec16(y_s.index(s).slice(c * CH, CH).load(YRAW), gl.convert_layout(sc, YRAW, assert_trivial=True),
                    BKB, True, True)
        d.slice(c * CH, CH).store(yv)
    fence_async_shared()
    w = gl.convert_layout(_dec16(x_s.index(s).load(RAW), sb, BKB, True, True), DOT, assert_trivial=True)
    gl.thread_barrier()  # every warp's part of the decoded tile is stored and fenced
    acc = warpgroup_mma(w, d.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=prev)
    return acc


@gluon.jit
def _consume(x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS,
             SWAP: gl.constexpr):
    """``_gluon._consume`` with Y decoded here too: acc [BN, BM] = X @ Y.T per tile, then the epilogue."""
    STAGES: gl.constexpr = x_s.type.shape[0]
    BN: gl.constexpr = x_s.type.shape[1]
    BKB: gl.constexpr = x_s.type.shape[2]
    BM: gl.constexpr = y_s.type.shape[1]
    RAW: gl.constexpr = raw_layout(BKB, BN // 16)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BN // 16, 1],
                                                  instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    lo = _first_tile(gl.program_id(0), TILES)
    for tile in range(lo, _first_tile(gl.program_id(0) + 1, TILES)):
        j = (tile - lo) * STEPS
        n0 = (tile % NT) * BN
        m0 = (tile // NT) * BM
        sptr, smask, t = scale_ptrs(sx_ptr, n0, CB, N, BN, BKB, RAW)
        sb = load_scales(sptr, smask, t, 0, KB)
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        # two steps per pass, for _gluon's reason: each step's register operand its own value
        for i in range(STEPS // 2):
            sb1 = load_scales(sptr, smask, t, (2 * i + 1) * BKB, KB)
            acc = _step(x_s, y_s, ys_s, d_s, ready, empty, j + 2 * i, i > 0, sb, acc, RAW, DOT)
            sb = load_scales(sptr, smask, t, (2 * i + 2) * BKB, KB)
            acc = _step(x_s, y_s, ys_s, d_s, ready, empty, j + 2 * i + 1, True, sb1, acc, RAW, DOT)
        if STEPS % 2 == 1:
            acc = _step(x_s, y_s, ys_s, d_s, ready, empty, j + STEPS - 1, STEPS > 1, sb, acc, RAW, DOT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((j + STEPS - 1) % STAGES))
        epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, SWAP)


# SWAP by wrapper, as in _gluon: a partition's constexpr arguments arrive as i32 values
@gluon.jit
def _consume_out(x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, False)


@gluon.jit
def _consume_swap(x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS):
    _consume(x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS, True)


@gluon.jit
def wgdy_kernel(x_desc, y_desc, ys_desc, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, NT, TILES, STEPS,
                BN: gl.constexpr, BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, SWAP: gl.constexpr):
    """acc [BN, BM] = X @ Y.T tiles as ``_gluon.wgws_kernel``'s (out [M, N] = acc.T, or with SWAP out [N, M] = acc),
    with Y as words (``y_desc``) and scales (``ys_desc``) in the ring and decoded by the consumers into three fp16
    tiles. Partitions: the consumers (default, BN / 16 warps), a TMA warp."""
    x_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], x_desc.layout)
    y_s = gl.allocate_shared_memory(gl.int64, [STAGES, BM, BKB], y_desc.layout)
    ys_s = gl.allocate_shared_memory(gl.int32, [STAGES, BM // 128, BKB // 4, 128], ys_desc.layout)
    d_s = gl.allocate_shared_memory(gl.float16, [3, BM, BKB * 16],
                                    gl.NVMMASharedLayout.get_default_for([BM, BKB * 16], gl.float16))
    ready, empty = _barriers(STAGES)
    cons = (x_s, y_s, ys_s, d_s, ready, empty, sx_ptr, alpha_ptr, out_ptr, M, N, KB, CB, TILES, NT, STEPS)
    load = (x_desc, y_desc, ys_desc, x_s, y_s, ys_s, ready, empty, TILES, NT, STEPS)
    if SWAP:
        gl.warp_specialize([(_consume_swap, cons), (_producer, load)], [1], [40])
    else:
        gl.warp_specialize([(_consume_out, cons), (_producer, load)], [1], [40])


def descriptors(x: torch.Tensor, y: torch.Tensor, sy: torch.Tensor, bn: int, bm: int, bkb: int) -> tuple:
    """TMA descriptors (cached: ``launch.tma_desc``) of X's words as int64 [rows, KB] (box [BN, BKB], ``wgws``'s),
    Y's words (box [BM, BKB], unswizzled) and Y's scales as the int32 view (g, j, 4i + q) of ``_gvws``
    (box [BM / 128, BKB / 4, 128])."""
    kb = x.shape[1] // 8
    cb = -(-kb // 4)
    _, ysl, yl, _ = _layouts()
    return (tma_desc(x.data_ptr(), torch.int64, (x.shape[0], kb), (kb, 1), (bn, bkb), layouts(bn, bm, bkb)[0]),
            tma_desc(y.data_ptr(), torch.int64, (y.shape[0], kb), (kb, 1), (bm, bkb), yl),
            tma_desc(sy.data_ptr(), torch.int32, (sy.numel() // (512 * cb), cb, 128), (128 * cb, 128, 1),
                     (bm // 128, bkb // 4, 128), ysl))


def run(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, alpha: torch.Tensor,
        out: torch.Tensor, config: dict) -> None:
    """Launch ``wgdy_kernel`` for ``config`` (BM 128 or 256, BN, BKB, stages; swap: X the activation; persist: one CTA
    per SM) on canonical operands (uint8 words, swizzled scale bytes viewed as uint8)."""
    from fp4dispatch.kernels.fused import _cdiv, _num_sms

    swap = bool(config.get("swap"))
    x, sx, y, sy = (a, sa, b, sb) if swap else (b, sb, a, sa)
    bm, bn, bkb = (int(config[key]) for key in ("BM", "BN", "BKB"))
    kb = x.shape[1] // 8
    if bm not in (128, 256) or kb % 2 or any(t.data_ptr() % 16 for t in (x, y, sy)):
        raise ValueError(f"wgdy needs BM 128 or 256, K % 32 == 0 and 16-byte aligned operands; got BM={bm}, "
                         f"K={kb * 16}")
    x_desc, y_desc, ys_desc = descriptors(x, y, sy, bn, bm, bkb)
    nt, steps = _cdiv(x.shape[0], bn), _cdiv(kb, bkb)
    tiles = nt * _cdiv(y.shape[0], bm)
    ctas = min(tiles, _num_sms(out.device)) if config.get("persist") else tiles
    launch(wgdy_kernel, (ctas,), x_desc, y_desc, ys_desc, sx, alpha, out, y.shape[0], x.shape[0], kb, _cdiv(kb, 4), nt,
           tiles, steps, BN=bn, BM=bm, BKB=bkb, STAGES=int(config["stages"]), SWAP=swap, num_warps=bn // 16)
