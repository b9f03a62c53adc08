"""``@triton.jit`` code of the fused NVFP4 x NVFP4 kernels (host side: ``fused.py``).

Decode without lookup tables: a nibble ``s e e m`` moved into an fp32 word (sign to bit 31, ``e e m`` to bits
24..22) *is* the float ``e2m1 * 2**-126`` (code 0.5 lands on an fp32 subnormal, exactly), so a nibble costs a few
integer ops and the ``2**126`` is folded into the per-block scale multiply. Every e2m1 x e4m3 product is exact in
fp32 and bf16, so the only rounding is fp32 accumulation and the final cast. Operands are kept scaled by ``2**-9``
(``SCALE_SHIFT``) so that ``e4m3 * 2**(126-9)`` fits fp32; the epilogue multiplies by ``2**18`` (exact) then alpha.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._h2 import H2_UNDO, H2_UNDO_CVT, h2_block, h2_block_cvt

try:  # griddepcontrol (programmatic dependent launch, SM90+); Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: the host never sets PDL
    gdc_wait = gdc_launch_dependents = None
HAS_GDC = gdc_wait is not None

TWO_120 = tl.constexpr(1.329227995784916e36)  # 2**120: e4m3 bits << 20 read as fp32 are value * 2**-120
TWO_117 = tl.constexpr(1.6615349947311448e35)  # 2**(126-9): folds the nibble's 2**-126 and the operand shift 2**-9
TWO_18 = tl.constexpr(262144.0)  # 2**(2*9): undoes the operand shifts of A and B
GEMV_C = tl.constexpr(64)  # GEMV: A is kept scaled by 2**64 so that (B nibble 2**-126) x A stays an fp32 normal
TWO_64 = tl.constexpr(1.8446744073709552e19)
TWO_126 = tl.constexpr(8.507059173023462e37)
TWO_62 = tl.constexpr(4.611686018427388e18)  # 2**(126-64): GEMV epilogue


@triton.jit
def e4m3_to_f32(u8):
    """float8_e4m3fn bytes (any int type) -> exact fp32 values; 0x7F/0xFF -> NaN (NaN scales propagate)."""
    u = u8.to(tl.uint32)
    mag = ((u & 0x7F) << 20).to(tl.float32, bitcast=True) * TWO_120
    v = tl.where((u & 0x80) != 0, -mag, mag)
    return tl.where((u & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def nib_lo(u):
    """Low nibble of each uint32-held byte -> e2m1 * 2**-126 (fp32)."""
    return (((u & 0x8) << 28) | ((u & 0x7) << 22)).to(tl.float32, bitcast=True)


@triton.jit
def nib_hi(u):
    """High nibble of each uint32-held byte -> e2m1 * 2**-126 (fp32)."""
    return (((u & 0x80) << 24) | ((u & 0x70) << 18)).to(tl.float32, bitcast=True)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL) a kernel may start while the previous one on its stream is still
    running; nothing may touch memory before this wait (the previous kernel's writes are visible after it). Only the
    A-decode kernel before ``wgds`` and ``wgws`` triggers its dependents early (``wmma_prep_a_kernel``'s EARLY): on
    the H200 an early trigger before ``wmma`` let its CTAs be placed unevenly (split 2 on N=8192: 68 -> 105 us)."""
    if PDL:
        gdc_wait()


@triton.jit
def _cast_store(acc, offs, omask, alpha_ptr, out_ptr):
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
        _cast_store(acc, offs, omask, alpha_ptr, out_ptr)


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
        _cast_store(total, offs, omask, alpha_ptr, out_ptr)


@triton.jit
def swz(r, c, CB):
    """Flat offset of block scale (row r, column c) in the 128x4-swizzled layout; CB = padded columns / 4."""
    return ((r // 128) * CB + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@triton.jit
def load_block_bytes(p_ptr, s_ptr, rows, nrows, kb0, kb_hi, K2, CB, BKB: tl.constexpr):
    """Bytes [R, BKB*8] (2-D, so loads vectorize to 16 B) as uint32 and their block scales [R, BKB] as exact fp32."""
    kk = kb0 * 8 + tl.arange(0, BKB * 8)
    blk = kb0 + tl.arange(0, BKB)
    m = (rows[:, None] < nrows) & (kk[None, :] < kb_hi * 8)
    u = tl.load(p_ptr + rows[:, None].to(tl.int64) * K2 + kk[None, :], mask=m, other=0).to(tl.uint32)
    ms = (rows[:, None] < nrows) & (blk[None, :] < kb_hi)
    s = e4m3_to_f32(tl.load(s_ptr + swz(rows[:, None], blk[None, :], CB), mask=ms, other=0))
    return u, s


@triton.jit
def per_byte(s, BK2: tl.constexpr):
    """Block scales [R, BKB] -> one per byte [R, BKB*8]."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], s.shape[1], 8)), (s.shape[0], BK2))


@triton.jit
def _operands(p_ptr, s_ptr, rows, nrows, kb0, kb_hi, K2, CB, BKB: tl.constexpr, DOT_F32: tl.constexpr):
    """Even-k and odd-k halves [R, BKB*8] of the dequantized rows (value * 2**-9), bf16 (fp32 when DOT_F32).
    A and B use the same split, so sum_k = dot(even) + dot(odd) with no interleave."""
    u, s = load_block_bytes(p_ptr, s_ptr, rows, nrows, kb0, kb_hi, K2, CB, BKB)
    s2 = per_byte(s * TWO_117, BKB * 8)
    lo = nib_lo(u) * s2
    hi = nib_hi(u) * s2
    if not DOT_F32:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def mma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
               blocks_per_split, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, GROUP_M: tl.constexpr,
               SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    """Tiled tensor-core GEMM: decode both operands in registers, bf16 dot, fp32 accumulate; split-K by
    program_id(1) (SPLIT: reduced by the tile's last CTA, see ``store_out``) or a direct alpha+cast epilogue."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, KB)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        a_lo, a_hi = _operands(a_ptr, sa_ptr, rm, M, kb0, kb_hi, K2, CB, BKB, DOT_F32)
        b_lo, b_hi = _operands(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB, DOT_F32)
        acc = tl.dot(a_lo, tl.trans(b_lo), acc)
        acc = tl.dot(a_hi, tl.trans(b_hi), acc)
    store_out(acc * TWO_18, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


@triton.jit
def gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K2, KB, CB,
                blocks_per_split, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr):
    """CUDA-core GEMV for M <= MB (no tensor-core padding to 16 rows): per 16-block, the exact fp32 sum of 16
    nibble products, times the B block scale, accumulated elementwise; one reduction after the K loop."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, MB)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, KB)
    BK2: tl.constexpr = BKB * 8
    acc = tl.zeros((MB, BN, BKB), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BKB):
        ub, sb = load_block_bytes(b_ptr, sb_ptr, rn, N, kb0, kb_hi, K2, CB, BKB)
        ua, sa = load_block_bytes(a_ptr, sa_ptr, rm, M, kb0, kb_hi, K2, CB, BKB)
        # A as exact values * 2**64: (nibble * 2**-126) * A is then an fp32 normal, and the 16-term sum is exact
        sa2 = per_byte(sa * TWO_64, BK2)
        a_lo = (nib_lo(ua) * TWO_126) * sa2
        a_hi = (nib_hi(ua) * TWO_126) * sa2
        prod = nib_lo(ub)[None, :, :] * a_lo[:, None, :] + nib_hi(ub)[None, :, :] * a_hi[:, None, :]
        part = tl.sum(tl.reshape(prod, (MB, BN, BKB, 8)), axis=3)
        acc += part * sb[None, :, :]
    res = tl.sum(acc, axis=2) * TWO_62
    store_out(res, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)


@triton.jit
def _nib(x, J: tl.constexpr):
    """Nibble J (0..7) of uint32 words -> e2m1 * 2**-126 (fp32): sign to bit 31, e e m to bits 24..22."""
    if J <= 5:
        e = x << (22 - 4 * J)
    else:
        e = x >> (4 * J - 22)
    return (((x << (28 - 4 * J)) & 0x80000000) | (e & 0x01C00000)).to(tl.float32, bitcast=True)


@triton.jit
def _top(c):
    return (c & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _dec8(x, PAIR: tl.constexpr):
    """The 8 nibbles of uint32 words (k order) as e2m1 * 2**-126 fp32.

    PAIR: one bit-select (a single lop3) builds a word in which two nibbles each have their sign 9 bits above their
    e e m (as in the fp32 target: bit 31 vs 24..22), so each nibble then costs one shift + one mask instead of two
    shifts, two masks and an or (~2.6 instead of ~4 integer ops per value)."""
    if PAIR:
        l6 = x << 6  # signs of nibbles 0..3 move 6 up; their e e m stay
        r6 = x >> 6  # e e m of nibbles 4..7 move 6 down; their signs stay
        c0 = (x & 0x77) | (l6 & 0xFFFFFF88)
        c1 = (x & 0x7700) | (l6 & 0xFFFF88FF)
        c2 = (r6 & 0x1DC00) | (x & 0xFFFE23FF)
        c3 = (r6 & 0x1DC0000) | (x & 0xFE23FFFF)
        return (_top(c0 << 22), _top(c0 << 18), _top(c1 << 14), _top(c1 << 10),
                _top(c2 << 12), _top(c2 << 8), _top(c3 << 4), _top(c3))
    else:
        return (_nib(x, 0), _nib(x, 1), _nib(x, 2), _nib(x, 3), _nib(x, 4), _nib(x, 5), _nib(x, 6), _nib(x, 7))


@triton.jit
def _dot8(x, y, sy, PAIR: tl.constexpr):
    """sum_j nib_j(x) * (nib_j(y) * 2**126 * sy): B nibbles x against A nibbles y (A decoded exactly, times sy)."""
    b0, b1, b2, b3, b4, b5, b6, b7 = _dec8(x, PAIR)
    a0, a1, a2, a3, a4, a5, a6, a7 = _dec8(y, PAIR)
    s = b0 * ((a0 * TWO_126) * sy)
    s += b1 * ((a1 * TWO_126) * sy)
    s += b2 * ((a2 * TWO_126) * sy)
    s += b3 * ((a3 * TWO_126) * sy)
    s += b4 * ((a4 * TWO_126) * sy)
    s += b5 * ((a5 * TWO_126) * sy)
    s += b6 * ((a6 * TWO_126) * sy)
    s += b7 * ((a7 * TWO_126) * sy)
    return s


@triton.jit
def _swz_row(r, CB):
    return (r // 128) * (CB * 512) + (r % 32) * 16 + ((r % 128) // 32) * 4


@triton.jit
def grid_tile(BN: tl.constexpr, BM: tl.constexpr, BKB: tl.constexpr):
    """Program ids of an (N tile, K split, M tile) grid -> (K split, N rows, M rows, block offsets of one K step)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(2) * BM + tl.arange(0, BM)
    return tl.program_id(1), rn, rm, tl.arange(0, BKB)


@triton.jit
def _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb0, kb_hi, EVEN_K: tl.constexpr):
    """Raw tiles of one K step at block kb0: B and A words (int64) and their scale bytes; all masked off (no memory
    traffic) once kb0 >= kb_hi, which the prefetch past the last step relies on."""
    kk = kb0 + t
    if EVEN_K:  # a mask constant along K keeps the loads 16-byte vectors: past the end, no row is live
        bmask = rn[:, None] < tl.where(kb0 < kb_hi, N, 0)
        amask = rm[:, None] < tl.where(kb0 < kb_hi, M, 0)
    else:
        bmask = (rn[:, None] < N) & (kk[None, :] < kb_hi)
        amask = (rm[:, None] < M) & (kk[None, :] < kb_hi)
    xb = tl.load(b_ptr + rn[:, None].to(tl.int64) * KB + kk[None, :], mask=bmask, other=0)
    sb = tl.load(sb_ptr + brow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=bmask, other=0)
    xa = tl.load(a_ptr + rm[:, None].to(tl.int64) * KB + kk[None, :], mask=amask, other=0)
    sa = tl.load(sa_ptr + arow[:, None] + (kb0 // 4) * 512 + scol[None, :], mask=amask, other=0)
    return xb, sb, xa, sa


@triton.jit
def gemv2_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KB, CB,
                 blocks_per_split, MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, PAIR: tl.constexpr,
                 SPLIT: tl.constexpr, H2: tl.constexpr = False, ASM: tl.constexpr = True, EVEN_K: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, CVT: tl.constexpr = False, PDL: tl.constexpr = False):
    """CUDA-core GEMV over int64 words (a, b viewed as int64 [rows, K/16]; one word = one 16-block, so a [BN, BKB]
    tile loads as 16-byte vectors and its scales line up one per word). Per block: 16 exact fp32 products summed
    exactly, one FMA with the B scale. MB == 1 stays 2-D; MB > 1 broadcasts [MB, 1, BKB] x [1, BN, BKB].
    H2: the products are formed two per instruction in fp16x2 (``h2_block``), still exact; ASM=False is its
    interpreter form. EVEN_K: every split is a whole number of BKB steps (the host checks), so no K mask.
    PREFETCH: double-buffer the raw tiles in registers. CVT (with H2, on SM89+): decode through e4m3 bytes and the
    hardware e4m3x2 -> f16x2 conversion; the interpreter runs the plain H2 form instead. PDL: see ``pdl_wait``."""
    pdl_wait(PDL)
    pid_k, rn, rm, t = grid_tile(BN, MB, BKB)
    # swizzled column offset of block t (kb0 % 4 == 0); written so that pairs of blocks look contiguous, like the
    # 2-word vectors of the data tile, so both loads get the same register layout
    scol = (t // 4) * 512 + ((t % 4) // 2) * 2 + t % 2
    brow = _swz_row(rn, CB)
    arow = _swz_row(rm, CB)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, KB)
    if MB == 1:
        acc = tl.zeros((BN, BKB), dtype=tl.float32)
    else:
        acc = tl.zeros((MB, BN, BKB), dtype=tl.float32)
    # PREFETCH: the next K step's raw tiles are loaded before this step's math (register double buffer), so a
    # warp keeps loads in flight while it decodes; Triton does not pipeline loads that feed no tl.dot
    if PREFETCH:
        nb, nsb, na, nsa = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb_lo,
                                     kb_hi, EVEN_K)
    for kb0 in range(kb_lo, kb_hi, BKB):
        if PREFETCH:
            xb, sbr, xa, sar = nb, nsb, na, nsa
            nb, nsb, na, nsa = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB,
                                         kb0 + BKB, kb_hi, EVEN_K)
        else:
            xb, sbr, xa, sar = _g2_tiles(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, arow, brow, scol, t, M, N, KB, kb0,
                                         kb_hi, EVEN_K)
        sb = e4m3_to_f32(sbr)
        sa = e4m3_to_f32(sar)
        if MB > 1:
            xb = xb[None, :, :]
            sb = sb[None, :, :]
            xa = xa[:, None, :]
            sa = sa[:, None, :]
        if H2:
            b_lo, b_hi = xb.to(tl.uint32), (xb >> 32).to(tl.uint32)
            a_lo, a_hi = xa.to(tl.uint32), (xa >> 32).to(tl.uint32)
            if CVT and ASM:
                s = h2_block_cvt(b_lo, b_hi, a_lo, a_hi)
            else:
                s = h2_block(b_lo, b_hi, a_lo, a_hi, ASM)
            acc += s * (sb * sa)
        else:
            sa = sa * TWO_64
            s = _dot8(xb.to(tl.uint32), xa.to(tl.uint32), sa, PAIR)
            s += _dot8((xb >> 32).to(tl.uint32), (xa >> 32).to(tl.uint32), sa, PAIR)
            acc += s * sb
    if H2 and CVT and ASM:
        undo = H2_UNDO_CVT
    elif H2:
        undo = H2_UNDO
    else:
        undo = TWO_62
    if MB == 1:
        res = tl.sum(acc, axis=1)[None, :] * undo
    else:
        res = tl.sum(acc, axis=2) * undo
    store_out(res, rm, rn, M, N, alpha_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT)
