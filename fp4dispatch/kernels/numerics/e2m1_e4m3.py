"""NVFP4 decode in ``@triton.jit`` code: e2m1 nibbles and e4m3 block scales to exact fp32, and the addresses of
the 128x4-swizzled scales.

Decode without lookup tables: a nibble ``s e e m`` moved into an fp32 word (sign to bit 31, ``e e m`` to bits
24..22) *is* the float ``e2m1 * 2**-126`` (code 0.5 lands on an fp32 subnormal, exactly), so a nibble costs a few
integer ops and the ``2**126`` is folded into the per-block scale multiply. Every e2m1 x e4m3 product is exact in
fp32 and bf16, so the only rounding is fp32 accumulation and the final cast. Operands are kept scaled by ``2**-9``
so that ``e4m3 * 2**(126-9)`` fits fp32; the epilogue multiplies by ``2**18`` (exact) then alpha.
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
    return load_block_bytes_at(p_ptr, s_ptr, rows, rows, rows < nrows, kb0, kb_hi, K2, CB, BKB)


@triton.jit
def load_block_bytes_at(p_ptr, s_ptr, rows, srows, rmask, kb0, kb_hi, K2, CB, BKB: tl.constexpr):
    """``load_block_bytes`` with each row's scales at row ``srows`` of the swizzled layout (a grouped operand's
    padded expert blocks) and rows kept by ``rmask``."""
    kk = kb0 * 8 + tl.arange(0, BKB * 8)
    blk = kb0 + tl.arange(0, BKB)
    m = rmask[:, None] & (kk[None, :] < kb_hi * 8)
    u = tl.load(p_ptr + rows[:, None].to(tl.int64) * K2 + kk[None, :], mask=m, other=0).to(tl.uint32)
    ms = rmask[:, None] & (blk[None, :] < kb_hi)
    s = e4m3_to_f32(tl.load(s_ptr + swz(srows[:, None], blk[None, :], CB), mask=ms, other=0))
    return u, s


@triton.jit
def per_byte(s, BK2: tl.constexpr):
    """Block scales [R, BKB] -> one per byte [R, BKB*8]."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], s.shape[1], 8)), (s.shape[0], BK2))



@triton.jit
def swz_row(r, CB):
    return (r // 128) * (CB * 512) + (r % 32) * 16 + ((r % 128) // 32) * 4


@triton.jit
def decoded_halves(p_ptr, s_ptr, rows, nrows, kb0, kb_hi, K2, CB, BKB: tl.constexpr, DOT_F32: tl.constexpr):
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
