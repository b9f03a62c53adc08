"""NVFP4 format: quantize/dequantize vs an independent per-element implementation, grid round trip, swizzle."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from fp4dispatch import InvalidInputError, dequantize_nvfp4, quantize_nvfp4, swizzle_scales, unswizzle_scales
from fp4dispatch.format import E2M1_VALUES

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _slow_e2m1_code(v: float) -> int:
    """Round-to-nearest-even onto the e2m1 grid with saturation, one value at a time, by search."""
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - a), i % 2))  # tie -> even code (mantissa bit 0)
    return best | sign


def _slow_quantize(x: torch.Tensor, gs: float):
    """Per-element reference of quantize_nvfp4 (linear scales), written independently of the library."""
    m, k = x.shape
    codes = torch.zeros(m, k, dtype=torch.uint8)
    scales = torch.zeros(m, k // 16, dtype=torch.float8_e4m3fn)
    g = torch.tensor(gs, dtype=torch.float32)
    for r in range(m):
        for blk in range(k // 16):
            vals = x[r, blk * 16:(blk + 1) * 16].float()
            amax = vals.abs().max()
            s = torch.clamp(amax * g / torch.tensor(6.0), max=448.0).to(torch.float8_e4m3fn)
            scales[r, blk] = s
            sd = s.float()
            inv = g / sd if sd > 0 else torch.tensor(0.0)
            for j in range(16):
                codes[r, blk * 16 + j] = _slow_e2m1_code(float(vals[j] * inv))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_slow_per_element(dtype):
    torch.manual_seed(0)
    x = (torch.randn(5, 64) * torch.logspace(-3, 3, 5).unsqueeze(1)).to(dtype)
    packed, scale, gs = quantize_nvfp4(x, scale_layout="linear")
    ref_packed, ref_scale = _slow_quantize(x, float(gs))
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))


def test_rounding_ties_and_saturation():
    # With gs=1 and block amax 6 the block scale is exactly 1, so values map straight onto the grid.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0, 0.1, 5.5]
    x = torch.tensor([ties + [6.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    packed, scale, _ = quantize_nvfp4(x, 1.0, scale_layout="linear")
    assert scale.float().item() == 1.0
    codes = torch.stack((packed & 0xF, packed >> 4), -1).flatten().tolist()
    got = [E2M1_VALUES[c] for c in codes[: len(ties)]]
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, 0.0, 6.0]
    # saturation: a value beyond the block scale's range clamps to +-6 (x gs / scale > 6 cannot happen by
    # construction, so force it with a scale that saturates at 448)
    big = torch.full((1, 16), 1e6)
    p, s, _ = quantize_nvfp4(big, 1.0, scale_layout="linear")
    assert s.float().item() == 448.0 and int(p[0, 0]) == 0x77


def test_exact_round_trip_on_grid():
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (7, 32))
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0])[torch.randint(0, 4, (7, 2))]
    x = torch.tensor(E2M1_VALUES)[codes] * scales.repeat_interleave(16, dim=1)
    x[:, 0] = 6.0 * scales[:, 0]  # make every block's amax a grid maximum so its scale is exact
    x[:, 16] = 6.0 * scales[:, 1]
    for layout in ("linear", "swizzled"):
        packed, scale, gs = quantize_nvfp4(x, 1.0, scale_layout=layout)
        back = dequantize_nvfp4(packed, scale, gs, scale_layout=layout)
        assert torch.equal(back, x)


def test_dequantize_with_default_global_scale_close_to_input():
    torch.manual_seed(2)
    x = torch.randn(64, 256)
    packed, scale, gs = quantize_nvfp4(x)
    back = dequantize_nvfp4(packed, scale, gs)
    rel = (back - x).norm() / x.norm()
    assert rel < 0.15  # NVFP4 quantization error of Gaussian data is ~0.1
    assert packed.shape == (64, 128) and scale.shape == (128, 16) and gs.dtype == torch.float32


def test_float4_dtype_and_uint8_scale_views_accepted():
    x = torch.randn(4, 32)
    packed, scale, gs = quantize_nvfp4(x)
    a = dequantize_nvfp4(packed, scale, gs)
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None:
        b = dequantize_nvfp4(packed.view(fp4), scale.view(torch.uint8), gs)
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_to_16_bit_is_exact(dtype):
    torch.manual_seed(4)
    packed, scale, _ = quantize_nvfp4(torch.randn(33, 64) * 100)
    assert torch.equal(dequantize_nvfp4(packed, scale, dtype=dtype).float(), dequantize_nvfp4(packed, scale))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_spoils_only_its_own_block(bad):
    """The global scale comes from the finite values, so every other block quantizes as if the bad value were 0: one
    bad token of a batch leaves the other rows' codes and scales alone (with it in the amax, gs was 1.0 for a NaN,
    which zeroed the scales of small blocks, or 0 for an inf, which made every value NaN)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[1, 20] = bad
    clean = x.clone()
    clean[1, 20] = 0
    q, s, g = quantize_nvfp4(x, scale_layout="linear")
    q0, s0, g0 = quantize_nvfp4(clean, scale_layout="linear")
    assert torch.equal(g, g0) and 0 < g.item() < float("inf")
    other = torch.ones(4, 4, dtype=torch.bool)
    other[1, 1] = False  # the bad value's block (k 16..31 of row 1)
    assert torch.equal(s.view(torch.uint8)[other], s0.view(torch.uint8)[other])
    assert torch.equal(q.view(4, 4, 8)[other], q0.view(4, 4, 8)[other])
    out = dequantize_nvfp4(q, s, g, scale_layout="linear")
    assert torch.isfinite(out[[0, 2, 3]]).all() and (out[[0, 2, 3]] != 0).any()


def test_a_global_scale_that_would_overflow_is_one():
    """An amax below about 8e-36 makes 448*6/amax overflow float32: gs is then 1.0, never inf (which gave zero blocks
    NaN scales)."""
    q, s, g = quantize_nvfp4(torch.full((2, 32), 1e-37))
    assert g.item() == 1.0 and not torch.isnan(dequantize_nvfp4(q, s, g)).any()


def test_nan_scale_propagates():
    x = torch.randn(2, 32)
    packed, scale, gs = quantize_nvfp4(x, scale_layout="linear")
    scale.view(torch.uint8)[1, 0] = 0x7F  # e4m3 NaN
    out = dequantize_nvfp4(packed, scale, gs, scale_layout="linear")
    assert torch.isnan(out[1, :16]).all() and torch.isfinite(out[1, 16:]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (128, 4), (130, 9), (300, 11)])
def test_swizzle_closed_form_and_inverse(rows, cols):
    lin = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    sw = swizzle_scales(lin)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert sw.shape == (rp, cp)
    flat = sw.flatten()
    nct = cp // 4
    for r in range(rows):
        for c in range(cols):
            off = ((r // 128) * nct + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[off] == lin[r, c]
    assert int(flat.sum()) == int(lin.sum())  # everything else is zero padding
    assert torch.equal(unswizzle_scales(sw, rows, cols), lin)
    assert torch.equal(unswizzle_scales(flat, rows, cols), lin)  # flattened input


def test_swizzle_keeps_e4m3_dtype():
    lin = torch.rand(3, 2).to(torch.float8_e4m3fn)
    sw = swizzle_scales(lin)
    assert sw.dtype == torch.float8_e4m3fn
    assert torch.equal(unswizzle_scales(sw, 3, 2).view(torch.uint8), lin.view(torch.uint8))


@pytest.mark.parametrize("call,match", [
    (lambda: quantize_nvfp4(torch.randn(2, 24)), r"K=x.shape\[1\] must be a multiple of 16.*Pad K with zeros to 32"),
    (lambda: quantize_nvfp4(torch.randn(32)), r"x must be a 2-D \[M, K\] tensor"),
    (lambda: quantize_nvfp4(torch.randint(0, 3, (2, 16))), r"x must be float32, bfloat16 or float16; got dtype=torch.int64"),
    (lambda: quantize_nvfp4(torch.randn(2, 16), torch.tensor([1.0], dtype=torch.bfloat16)),
     r"global_scale must be a float32 tensor with one element; got dtype=torch.bfloat16"),
    (lambda: quantize_nvfp4(torch.randn(2, 16), 0.0),
     r"global_scale must be a positive finite number \(448\*6/amax\), a float32 tensor, or None; got 0.0"),
    (lambda: quantize_nvfp4(torch.randn(2, 16), scale_layout="tiled"), r"scale_layout must be one of .*got 'tiled'"),
    (lambda: dequantize_nvfp4(torch.randn(2, 8), torch.zeros(128, 4, dtype=torch.float8_e4m3fn)),
     r"packed must be packed NVFP4 data .*quantize first with quantize_nvfp4"),
    (lambda: unswizzle_scales(torch.zeros(10, dtype=torch.uint8), 3, 2),
     r"^unswizzle_scales: a swizzled scale for rows=3, cols=2 has 128\*4=512 elements \(padded to 128x4 tiles\); got "
     r"shape=\(10,\)\. Pass the rows and cols of the linear scale it was swizzled from$"),
    (lambda: swizzle_scales(torch.zeros(4, dtype=torch.uint8)),
     r"^swizzle_scales: linear must be a 2-D \[rows, K/16\] tensor of block scales; got shape=\(4,\), "
     r"dtype=torch.uint8\. Pass the scales as quantize_nvfp4\(x, scale_layout='linear'\) returns them$"),
], ids=["k-not-16", "rank", "int-input", "bf16-global-scale", "zero-global-scale", "layout", "dequant-float", "unswizzle-size",
        "swizzle-rank"])
def test_format_errors(call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()


_Q, _S, _ = quantize_nvfp4(torch.randn(4, 32))  # packed [4, 16], swizzled scale [128, 4]
_GS_NUMBER = r"global_scale must be a positive finite number \(448\*6/amax\), a float32 tensor, or None; got "
_GS_TENSOR = r"global_scale must be a float32 tensor with one element; got "
_PER_TENSOR = r"\(NVFP4 has one global scale per tensor: pass that one value, not a per-row or per-column scale\)$"
_IN_FP32 = r"\(compute it in float32: a bf16 global scale silently corrupts scales in some libraries\)$"
FORMAT_ARGUMENT_ERRORS = [
    ("gs-per-column", lambda: dequantize_nvfp4(_Q, _S, torch.ones(32)),
     rf"^dequantize_nvfp4: {_GS_TENSOR}dtype=torch.float32, shape=\(32,\) {_PER_TENSOR}"),
    ("gs-wrong-size", lambda: dequantize_nvfp4(_Q, _S, torch.ones(3)), rf"shape=\(3,\) {_PER_TENSOR}"),
    ("gs-bf16", lambda: dequantize_nvfp4(_Q, _S, torch.ones(1, dtype=torch.bfloat16)),
     rf"^dequantize_nvfp4: {_GS_TENSOR}dtype=torch.bfloat16, shape=\(1,\) {_IN_FP32}"),
    ("gs-int-tensor", lambda: dequantize_nvfp4(_Q, _S, torch.ones(1, dtype=torch.int32)),
     rf"^dequantize_nvfp4: {_GS_TENSOR}dtype=torch.int32"),
    ("gs-bool-tensor", lambda: dequantize_nvfp4(_Q, _S, torch.ones(1, dtype=torch.bool)),
     rf"^dequantize_nvfp4: {_GS_TENSOR}dtype=torch.bool"),
    ("gs-bool", lambda: dequantize_nvfp4(_Q, _S, True),
     rf"^dequantize_nvfp4: {_GS_NUMBER}True \(bool\)\. Pass the encode scale 448\*6/amax\(x\), at most 3.403e\+38 "
     r"\(float32\)$"),
    ("gs-str", lambda: dequantize_nvfp4(_Q, _S, "2688"), rf"^dequantize_nvfp4: {_GS_NUMBER}'2688' \(str\)\. Pass"),
    ("gs-negative", lambda: dequantize_nvfp4(_Q, _S, -1.0), rf"^dequantize_nvfp4: {_GS_NUMBER}-1.0 \(float\)"),
    # 0 in float32: quantize returned gs = 0 and zero scales, dequantize +-Inf
    ("gs-zero-in-f32", lambda: quantize_nvfp4(torch.randn(2, 16), 1e-46),
     rf"^quantize_nvfp4: {_GS_NUMBER}1e-46 \(float\)"),
    ("gs-zero-in-f32-dequant", lambda: dequantize_nvfp4(_Q, _S, 1e-46), rf"^dequantize_nvfp4: {_GS_NUMBER}1e-46"),
    ("gs-past-f32", lambda: quantize_nvfp4(torch.randn(2, 16), 1e39),
     rf"^quantize_nvfp4: {_GS_NUMBER}1e\+39 \(float\)"),
    ("gs-bool-quantize", lambda: quantize_nvfp4(torch.randn(2, 16), True), rf"^quantize_nvfp4: {_GS_NUMBER}True"),
    ("gs-tensor-zero", lambda: quantize_nvfp4(torch.randn(2, 16), torch.zeros(1)),
     r"^quantize_nvfp4: global_scale must hold a positive finite encode scale \(448\*6/amax\); got a tensor holding "
     r"0\.0\. An amax of 0 or inf/NaN in the data gives such a scale: compute it from data with a finite, nonzero "
     r"amax$"),
    ("gs-tensor-inf", lambda: dequantize_nvfp4(_Q, _S, torch.full((1,), float("inf"))),
     r"^dequantize_nvfp4: global_scale must hold a positive finite encode scale .*; got a tensor holding inf\."),
    ("gs-tensor-nan", lambda: dequantize_nvfp4(_Q, _S, torch.full((1, 1), float("nan"))),
     r"^dequantize_nvfp4: global_scale must hold .*; got a tensor holding nan\."),
    ("gs-tensor-negative", lambda: quantize_nvfp4(torch.randn(2, 16), torch.tensor([-2.0])),
     r"^quantize_nvfp4: global_scale must hold .*; got a tensor holding -2\.0\."),
    ("gs-per-row-quantize", lambda: quantize_nvfp4(torch.randn(2, 16), torch.ones(2)),
     rf"^quantize_nvfp4: {_GS_TENSOR}dtype=torch.float32, shape=\(2,\) {_PER_TENSOR}"),
    ("packed-none", lambda: dequantize_nvfp4(None, _S),
     r"^dequantize_nvfp4: packed must be a tensor of packed NVFP4 codes \[M, K/2\], as quantize_nvfp4 returns them; "
     r"got NoneType$"),
    ("scale-none", lambda: dequantize_nvfp4(_Q, None),
     r"^dequantize_nvfp4: scale must be a tensor of float8_e4m3fn block scales, as quantize_nvfp4 returns them; got "
     r"NoneType$"),
    ("scale-swizzled-size", lambda: dequantize_nvfp4(_Q, _S[:64]),
     r"^dequantize_nvfp4: scale with scale_layout='swizzled' must have shape \(128, 4\) = \(round_up\(M=4,128\), "
     r"round_up\(K/16=2,4\)\) or that many elements flattened; got scale.shape=\(64, 4\)\. Pass the scale made with "
     r"this packed \(swizzle_scales makes it from the linear \[M, K/16\] one\)$"),
    ("scale-is-linear", lambda: dequantize_nvfp4(_Q, unswizzle_scales(_S, 4, 2)),
     r"got scale.shape=\(4, 2\)\. It has the linear layout's shape: pass scale_layout='linear'$"),
    ("scale-is-swizzled", lambda: dequantize_nvfp4(_Q, _S, scale_layout="linear"),
     r"^dequantize_nvfp4: scale with scale_layout='linear' must have shape \(4, 2\) = \(M, K/16\); got "
     r"scale.shape=\(128, 4\)\. It has the swizzled layout's shape: pass scale_layout='swizzled'$"),
    ("swizzle-none", lambda: swizzle_scales(None),
     r"^swizzle_scales: linear must be a 2-D \[rows, K/16\] tensor of block scales; got NoneType\. Pass"),
    ("unswizzle-none", lambda: unswizzle_scales(None, 3, 2),
     r"^unswizzle_scales: swizzled must be a tensor of 128x4-swizzled block scales \(what swizzle_scales returns\); "
     r"got NoneType$"),
    ("unswizzle-float-rows", lambda: unswizzle_scales(_S, 3.0, 2),
     r"^unswizzle_scales: rows must be a non-negative int, the linear scale's rows \(M or N\); got 3.0 \(float\)\. "
     r"Pass int\(rows\) if it is a whole number$"),
    ("unswizzle-negative-cols", lambda: unswizzle_scales(_S, 3, -2),
     r"^unswizzle_scales: cols must be a non-negative int, the linear scale's cols \(K/16\); got -2 \(int\)"),
]


@pytest.mark.parametrize("call, match", [c[1:] for c in FORMAT_ARGUMENT_ERRORS],
                         ids=[c[0] for c in FORMAT_ARGUMENT_ERRORS])
def test_format_helpers_check_their_arguments(call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()


def test_a_global_scale_divides_as_before_and_numpy_numbers_are_taken():
    q, s, g = quantize_nvfp4(torch.randn(4, 32))
    ref = dequantize_nvfp4(q, s) / g
    assert torch.equal(dequantize_nvfp4(q, s, g), ref)
    assert torch.equal(dequantize_nvfp4(q, s, float(g)), ref)
    assert torch.equal(dequantize_nvfp4(q, s, np.float32(g.item())), ref)
    assert torch.equal(quantize_nvfp4(torch.randn(4, 32), np.float32(2.5))[2], torch.tensor([2.5]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float8_e4m3fn, "float32"])
def test_dequantize_refuses_a_dtype_that_cannot_hold_the_values(dtype):
    """uint8 raised torch's overflow error, "float32" a TypeError; int32 and e4m3 returned truncated values."""
    q, s, _ = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(InvalidInputError, match=r"^dequantize_nvfp4: dtype must be torch.float32, torch.bfloat16, "
                                                r"torch.float16 or torch.float64 \(the decoded values\); got "
                                                + re.escape(repr(dtype)) + "$"):
        dequantize_nvfp4(q, s, dtype=dtype)
    assert torch.equal(dequantize_nvfp4(q, s, dtype=torch.float64), dequantize_nvfp4(q, s).double())


def test_a_global_scale_that_requires_grad_is_taken_as_a_value():
    """It warned (float() of a tensor that requires grad) and the returned scale required grad."""
    import warnings

    gs = torch.tensor([2.5], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, s, g = quantize_nvfp4(torch.randn(4, 32), gs)
        out = dequantize_nvfp4(q, s, gs)
    assert not g.requires_grad and not out.requires_grad and torch.equal(g, gs.detach())
