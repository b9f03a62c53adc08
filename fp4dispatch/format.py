"""The NVFP4 format: quantize, dequantize, and the 128x4 scale swizzle.

NVFP4 stores a [M, K] matrix as
  * packed e2m1 codes, uint8 [M, K/2], two per byte, the **low nibble holding the even k**;
  * one float8_e4m3fn block scale per 16 consecutive K elements, either linear [M, K/16] or swizzled into the
    128x4 tiles that native kernels read, zero-padded to [round_up(M, 128), round_up(K/16, 4)];
  * a float32 global *encode* scale ``gs = 448 * 6 / amax(x)``; the value is ``code * scale / gs``.

Everything here runs on CPU and CUDA with plain torch ops. On CUDA, ``quantize_nvfp4`` uses the Triton quantize
kernel when Triton is importable (bit-identical to the torch path, which stays the definition).
"""
from __future__ import annotations

import numbers

import torch

from .errors import InvalidInputError

__all__ = [
    "E2M1_VALUES",
    "BLOCK",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzled_scale_shape",
    "as_packed_uint8",
    "as_e4m3",
]

BLOCK = 16  # K elements per e4m3 block scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_F32_MAX = torch.finfo(torch.float32).max
# Code -> value for the 16 e2m1 codes (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_LAYOUTS = ("swizzled", "linear")

_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_scale_shape(rows: int, k: int) -> tuple[int, int]:
    """Shape of the padded 128x4-swizzled scale tensor for a [rows, k] matrix (k in elements)."""
    return _round_up(rows, 128), _round_up(k // BLOCK, 4)


def _e2m1_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
        _LUT_CACHE[key] = lut
    return lut


def packed_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one packed NVFP4 data comes in: uint8 or ``torch.float4_e2m1fn_x2`` (where torch has it)."""
    return dtype == torch.uint8 or dtype == getattr(torch, "float4_e2m1fn_x2", None)


def as_packed_uint8(t: torch.Tensor, name: str = "packed") -> torch.Tensor:
    """View packed e2m1 data as uint8 (accepts uint8 or ``torch.float4_e2m1fn_x2``)."""
    if t.dtype == torch.uint8:
        return t
    if packed_dtype(t.dtype):
        return t.view(torch.uint8)
    raise InvalidInputError(
        f"{name} must be packed NVFP4 data (uint8 or torch.float4_e2m1fn_x2, two e2m1 values per byte); "
        f"got dtype={t.dtype}. If this is an unquantized matrix, quantize first with quantize_nvfp4"
    )


def as_e4m3(t: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """View block scales as float8_e4m3fn (accepts float8_e4m3fn or a uint8 view of it)."""
    if t.dtype == torch.float8_e4m3fn:
        return t
    if t.dtype == torch.uint8:
        return t.view(torch.float8_e4m3fn)
    raise InvalidInputError(
        f"{name} must hold float8_e4m3fn block scales (or their uint8 bytes); got dtype={t.dtype}. "
        f"Convert with .to(torch.float8_e4m3fn) only if the values are already e4m3-representable block scales"
    )


def _check_layout(scale_layout: str) -> None:
    if scale_layout not in SCALE_LAYOUTS:
        raise InvalidInputError(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")


def _global_scale(global_scale: object, device: torch.device, call: str) -> torch.Tensor | None:
    """``global_scale`` as ``quantize_nvfp4`` and ``dequantize_nvfp4`` take it (None, a positive number that is
    finite in float32, or a float32 tensor of one element), as a float32 [1] tensor on ``device`` (None stays None);
    InvalidInputError naming ``call`` otherwise. A CPU tensor's value is checked as a number's (in eager calls); a GPU
    tensor's is not: reading it would wait for the GPU (a host sync) and cannot be done during CUDA graph capture."""
    if global_scale is None:
        return None
    if isinstance(global_scale, torch.Tensor):
        global_scale = global_scale.detach()  # a scale, never a value to differentiate: no autograd history out
        if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
            why = ("NVFP4 has one global scale per tensor: pass that one value, not a per-row or per-column scale"
                   if global_scale.numel() != 1 else
                   "compute it in float32: a bf16 global scale silently corrupts scales in some libraries")
            raise InvalidInputError(f"{call}: global_scale must be a float32 tensor with one element; got "
                                    f"dtype={global_scale.dtype}, shape={tuple(global_scale.shape)} ({why})")
        # not while tracing (torch.compile, torch.export): the value is data-dependent there; eager checks it
        if (global_scale.device.type == "cpu" and not torch.compiler.is_compiling()
                and not 0 < float(global_scale) <= _F32_MAX):
            raise InvalidInputError(f"{call}: global_scale must hold a positive finite encode scale (448*6/amax); "
                                    f"got a tensor holding {float(global_scale)!r}. An amax of 0 or inf/NaN in the "
                                    f"data gives such a scale: compute it from data with a finite, nonzero amax")
        return global_scale.reshape(1).to(device)
    value = None
    if isinstance(global_scale, numbers.Real) and not isinstance(global_scale, bool):  # Python and NumPy numbers
        try:
            value = float(global_scale)
        except OverflowError:  # an int past the float range
            pass
    if value is not None:  # as the float32 it becomes: 1e-46 is 0 there (gs = 0, dequantize gave Inf)
        value = float(torch.tensor(value, dtype=torch.float32))
    if value is None or not 0 < value <= _F32_MAX:
        text = repr(global_scale) if len(repr(global_scale)) <= 24 else repr(global_scale)[:20] + "..."
        raise InvalidInputError(f"{call}: global_scale must be a positive finite number (448*6/amax), a float32 "
                                f"tensor, or None; got {text} ({type(global_scale).__name__}). Pass the encode scale "
                                f"448*6/amax(x), at most {_F32_MAX:.4g} (float32)")
    return torch.tensor([value], dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------------------------
# 128x4 swizzle
# ---------------------------------------------------------------------------------------------------------------
def swizzle_scales(linear: torch.Tensor) -> torch.Tensor:
    """Linear [rows, cols] block scales -> zero-padded 128x4-swizzled [round_up(rows,128), round_up(cols,4)].

    Element (r, c) lands at flat offset ``((r//128)*ceil(cols/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.
    """
    if not isinstance(linear, torch.Tensor) or linear.dim() != 2:
        raise InvalidInputError(f"swizzle_scales: linear must be a 2-D [rows, K/16] tensor of block scales; got "
                                f"{_describe(linear)}. Pass the scales as quantize_nvfp4(x, scale_layout='linear') "
                                "returns them")
    rows, cols = linear.shape
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    u8 = linear.view(torch.uint8) if linear.element_size() == 1 and linear.dtype != torch.uint8 else linear
    padded = torch.zeros((rp, cp), dtype=u8.dtype, device=linear.device)
    padded[:rows, :cols] = u8
    out = padded.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2)
    out = out.reshape(rp, cp)
    return out.view(linear.dtype) if out.dtype != linear.dtype else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: 2-D [Rp, Cp] or flattened swizzled scales -> linear [rows, cols]."""
    if not isinstance(swizzled, torch.Tensor):
        raise InvalidInputError(f"unswizzle_scales: swizzled must be a tensor of 128x4-swizzled block scales (what "
                                f"swizzle_scales returns); got {_describe(swizzled)}")
    for name, v, what in (("rows", rows, "M or N"), ("cols", cols, "K/16")):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise InvalidInputError(f"unswizzle_scales: {name} must be a non-negative int, the linear scale's "
                                    f"{name} ({what}); got {v!r} ({type(v).__name__}). Pass int({name}) if it is a "
                                    "whole number")
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    if swizzled.numel() != rp * cp:
        raise InvalidInputError(
            f"unswizzle_scales: a swizzled scale for rows={rows}, cols={cols} has {rp}*{cp}={rp * cp} elements "
            f"(padded to 128x4 tiles); got shape={tuple(swizzled.shape)}. Pass the rows and cols of the linear "
            "scale it was swizzled from"
        )
    return _unswizzle(swizzled, rows, cols)


def _unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # unswizzle_scales past its checks (rows and cols may be symbolic ints here: dequantize_nvfp4 under torch.compile)
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    t = swizzled.contiguous().view(rp // 128, cp // 4, 32, 4, 4)  # [tile_r, tile_c, r%32, (r%128)//32, c%4]
    t = t.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return t[:rows, :cols]


# ---------------------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------------------
def default_global_scale(x: torch.Tensor) -> torch.Tensor:
    """``448*6/amax`` over x's finite values, as a float32 1-element tensor; 1.0 where that is not a finite positive
    number (x empty, all zero or not finite, or its amax so small that the quotient overflows). A NaN or inf is left
    out so that it spoils only its own 16-value block (through that block's scale), not the whole tensor: with it in
    the amax, gs would be 1.0 (NaN: the blocks of small values then get zero scales) or 0 (inf: every value NaN).
    The quotient is torch's scalar / tensor, ``reciprocal(amax) * 2688``, not always the correctly rounded one (its
    last bit may differ): it is the definition the CUDA kernel (``kernels.quantize``) matches bit for bit."""
    if x.numel() == 0:
        return torch.ones(1, dtype=torch.float32, device=x.device)
    a = x.detach().abs()
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax().float()
    gs = (E4M3_MAX * E2M1_MAX) / amax
    return torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs)).reshape(1)


def _round_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8), round-to-nearest-even with saturation (PTX ``cvt.rn.satfinite.e2m1x2``)."""
    a = v.abs()
    # Midpoints between grid values; at a tie, '>=' rounds up to the even code and '>' keeps the even code below.
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _quantize_torch(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xf = x.float().reshape(m, k // BLOCK, BLOCK)
    bamax = xf.abs().amax(dim=-1)
    # scale = e4m3(min(amax_blk * gs / 6, 448)): the fp32 ops in this order are the definition the kernel matches.
    sf32 = torch.clamp(bamax * gs / E2M1_MAX, max=E4M3_MAX)
    sf = sf32.to(torch.float8_e4m3fn)
    sfd = sf.float()
    inv = torch.where(sfd > 0, gs / sfd, torch.zeros_like(sfd))
    codes = _round_e2m1_codes(xf * inv.unsqueeze(-1)).reshape(m, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), sf


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, scale_layout: str = "swizzled"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a [M, K] float matrix to NVFP4.

    Args:
        x: float32/bf16/fp16 [M, K] with K % 16 == 0, on CPU or CUDA.
        global_scale: the encode scale (float32 1-element tensor or float); default ``448*6/amax(x)``. Its value must
            be positive and finite; that of a GPU tensor is not checked (it would cost a host sync).
        scale_layout: ``"swizzled"`` (128x4 tiles, zero-padded, what native kernels read) or ``"linear"`` [M, K/16].

    Returns:
        ``(packed uint8 [M, K/2], scale float8_e4m3fn, global_scale float32 [1])``.
    """
    _check_layout(scale_layout)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidInputError(f"quantize_nvfp4: x must be a 2-D [M, K] tensor; got {_describe(x)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInputError(f"quantize_nvfp4: x must be float32, bfloat16 or float16; got dtype={x.dtype}")
    if x.shape[1] % BLOCK:
        raise InvalidInputError(
            f"quantize_nvfp4: K=x.shape[1] must be a multiple of {BLOCK} (one e4m3 scale per 16 values); "
            f"got x.shape={tuple(x.shape)}. Pad K with zeros to {_round_up(x.shape[1], BLOCK)}"
        )
    gs = _global_scale(global_scale, x.device, "quantize_nvfp4")  # None: 448*6/amax(x), below
    x = x.contiguous()
    if x.is_cuda and x.shape[0] > 0:
        from .kernels import quantize as _tq

        if _tq.available():  # one launch with a global scale given, two without (amax, then quantize)
            if gs is None:
                return _tq.quantize_dynamic(x, swizzled=scale_layout == "swizzled")
            packed, sf = _tq.quantize(x, gs, swizzled=scale_layout == "swizzled")
            return packed, sf, gs
    gs = default_global_scale(x) if gs is None else gs
    packed, sf = _quantize_torch(x, gs)
    if scale_layout == "swizzled":
        sf = swizzle_scales(sf)
    return packed, sf, gs


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    scale_layout: str = "swizzled",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 -> dense [M, K] ``dtype``: ``code * scale / global_scale`` (exact in float32; exact in bf16/fp16 when
    ``global_scale`` is None, since every e2m1 x e4m3 product fits them).

    NaN block scales (e4m3 0x7F/0xFF) give NaN in their 16 values.
    """
    _check_layout(scale_layout)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise InvalidInputError(f"dequantize_nvfp4: dtype must be torch.float32, torch.bfloat16, torch.float16 or "
                                f"torch.float64 (the decoded values); got {dtype!r}")
    for name, t, what in (("packed", packed, "packed NVFP4 codes [M, K/2]"),
                          ("scale", scale, "float8_e4m3fn block scales")):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"dequantize_nvfp4: {name} must be a tensor of {what}, as quantize_nvfp4 returns "
                                    f"them; got {_describe(t)}")
    p = as_packed_uint8(packed, "packed")
    s = as_e4m3(scale, "scale")
    if p.dim() != 2:
        raise InvalidInputError(f"dequantize_nvfp4: packed must be 2-D [M, K/2]; got shape={tuple(p.shape)}")
    m, k = p.shape[0], p.shape[1] * 2
    if k % BLOCK:
        raise InvalidInputError(f"dequantize_nvfp4: K=2*packed.shape[1]={k} must be a multiple of {BLOCK}")
    gs = _global_scale(global_scale, p.device, "dequantize_nvfp4")
    sw, lin = swizzled_scale_shape(m, k), (m, k // BLOCK)
    if scale_layout == "swizzled":
        if s.numel() != sw[0] * sw[1]:
            hint = ("It has the linear layout's shape: pass scale_layout='linear'" if tuple(s.shape) == lin else
                    "Pass the scale made with this packed (swizzle_scales makes it from the linear [M, K/16] one)")
            raise InvalidInputError(
                f"dequantize_nvfp4: scale with scale_layout='swizzled' must have shape {sw} = (round_up(M={m},128), "
                f"round_up(K/16={k // BLOCK},4)) or that many elements flattened; got scale.shape="
                f"{tuple(s.shape)}. {hint}")
        s = _unswizzle(s, m, k // BLOCK)
    elif tuple(s.shape) != lin:
        hint = ("It has the swizzled layout's shape: pass scale_layout='swizzled'" if s.numel() == sw[0] * sw[1]
                else "Pass the linear scale made with this packed")
        raise InvalidInputError(f"dequantize_nvfp4: scale with scale_layout='linear' must have shape {lin} = (M, "
                                f"K/16); got scale.shape={tuple(s.shape)}. {hint}")
    # code x scale is exact in any float dtype of >= 8 significand bits; a global scale divides in fp32 first
    work = dtype if gs is None else torch.float32
    out = (_decode(p, work).view(m, k // BLOCK, BLOCK) * s.to(work).unsqueeze(-1)).view(m, k)
    if gs is not None:
        out = out / gs
    return out.to(dtype)


def _decode(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [M, K/2] -> e2m1 values [M, K] in ``dtype`` (low nibble first)."""
    lut = _e2m1_lut(p.device, dtype)
    lo = lut[(p & 0xF).long()]
    hi = lut[(p >> 4).long()]
    return torch.stack((lo, hi), dim=-1).reshape(p.shape[0], p.shape[1] * 2)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape={tuple(x.shape)}, dtype={x.dtype}"
    return f"{type(x).__name__}"
