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
def mma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, M, N, K2, KB, CB, blocks_per_split,
               BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, GROUP_M: tl.constexpr,
               ATOMIC: tl.constexpr, DOT_F32: tl.constexpr):
    """Tiled tensor-core GEMM: decode both operands in registers, bf16 dot, fp32 accumulate; split-K by
    program_id(1) with fp32 atomics into a workspace (ATOMIC) or a direct alpha+cast epilogue."""
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
    acc = acc * TWO_18
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + offs, acc, mask=omask, sem="relaxed")
    else:
        acc = acc * tl.load(alpha_ptr)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, alpha_ptr, out_ptr, M, N, K2, KB, CB, blocks_per_split,
                MB: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, ATOMIC: tl.constexpr):
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
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + offs, res, mask=omask, sem="relaxed")
    else:
        res = res * tl.load(alpha_ptr)
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def finalize_kernel(ws_ptr, alpha_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """out = alpha * workspace (split-K partial sums), cast to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    v = tl.load(ws_ptr + offs, mask=m, other=0.0) * tl.load(alpha_ptr)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m)
