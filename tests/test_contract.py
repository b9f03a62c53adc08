"""fp4_mm's input contract: every bad-input class raises InvalidInputError with a message that explains it,
and the exact reference path agrees with a float64 computation."""
from __future__ import annotations

import pytest
import torch

import fp4dispatch
from fp4dispatch import InvalidInputError, dequantize_nvfp4, fp4_mm, quantize_nvfp4
from fp4dispatch.testing import make_nvfp4_inputs


def _inputs(m=4, n=40, k=64, seed=0):
    return make_nvfp4_inputs(m, n, k, seed=seed)


def _f64_ref(a, b, sa, sb, alpha, layout="swizzled"):
    da = dequantize_nvfp4(a, sa, scale_layout=layout).double()
    db = dequantize_nvfp4(b, sb, scale_layout=layout).double()
    return (da @ db.T) * float(alpha)


@pytest.mark.parametrize("m", [1, 3, 127])
@pytest.mark.parametrize("n", [40, 96])
@pytest.mark.parametrize("k", [16, 4096])
@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
def test_fp4_mm_matches_float64(m, n, k, out_dtype, tol):
    a, b, sa, sb, alpha = _inputs(m, n, k, seed=m * 7 + n + k)
    if out_dtype == torch.float16:
        alpha = alpha * 1e-3  # keep sums of K=4096 products inside fp16's range (65504)
    out = fp4_mm(a, b, sa, sb, alpha, out_dtype=out_dtype)
    ref = _f64_ref(a, b, sa, sb, alpha)
    assert out.dtype == out_dtype and out.shape == (m, n)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel <= tol, rel


def test_linear_layout_and_out_argument_and_float_alpha():
    a, b, sa, sb, alpha = _inputs()
    from fp4dispatch import unswizzle_scales

    la, lb = unswizzle_scales(sa, 4, 4), unswizzle_scales(sb, 40, 4)
    out = torch.full((4, 40), float("nan"))
    got = fp4_mm(a, b, la, lb, float(alpha), out_dtype=torch.float32, out=out, scale_layout="linear")
    assert got is out
    ref = _f64_ref(a, b, sa, sb, alpha)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_zero_dim_alpha_accepted():
    a, b, sa, sb, alpha = _inputs()
    out = fp4_mm(a, b, sa, sb, alpha.reshape(()), out_dtype=torch.float32)
    ref = _f64_ref(a, b, sa, sb, alpha)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_alpha_none_is_one_and_flattened_scales_accepted():
    a, b, sa, sb, _ = _inputs()
    out = fp4_mm(a, b, sa.flatten(), sb.flatten(), None, out_dtype=torch.float32)
    ref = _f64_ref(a, b, sa, sb, 1.0)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_float4_and_uint8_views_accepted():
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    a, b, sa, sb, alpha = _inputs()
    x = fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    y = fp4_mm(a.view(fp4), b.view(fp4), sa.view(torch.uint8), sb.view(torch.uint8), alpha, out_dtype=torch.float32)
    assert torch.equal(x, y)


def _op_call(op, m, n, k=64, e=3):
    """``op`` and its arguments for an [m, n] result (the grouped ops: E=e experts, every row on the last)."""
    from fp4dispatch.format_grouped import swizzle_expert_scales, swizzle_grouped_scales

    a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    if op == "fp4_mm":
        return fp4dispatch.fp4_mm, (a, b, sa, sb, alpha)
    if op == "w4a16_mm":
        return fp4dispatch.w4a16_mm, (x, b, sb, alpha)
    offs = torch.tensor([0] * (e - 1) + [m], dtype=torch.int32)
    bs = b.unsqueeze(0).expand(e, -1, -1).contiguous()
    sbs = swizzle_expert_scales(torch.ones(e, n, k // 16, dtype=torch.float8_e4m3fn))
    if op == "fp4_grouped_mm":
        sas = swizzle_grouped_scales(torch.ones(m, k // 16, dtype=torch.float8_e4m3fn), offs)
        return fp4dispatch.fp4_grouped_mm, (a, bs, sas, sbs, alpha, offs)
    return fp4dispatch.w4a16_grouped_mm, (x, bs, sbs, alpha, offs)


@pytest.mark.parametrize("op", ["fp4_mm", "w4a16_mm", "fp4_grouped_mm", "w4a16_grouped_mm"])
@pytest.mark.parametrize("m, n", [(0, 40), (4, 0), (0, 0)])
def test_an_empty_m_or_n_returns_empty_and_still_checks_the_backend_name(monkeypatch, op, m, n):
    fn, args = _op_call(op, m, n)
    out = fn(*args)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    given = torch.empty(m, n, dtype=torch.float32)
    assert fn(*args, out_dtype=torch.float32, out=given) is given
    assert fn(*args, backend="reference").shape == (m, n)
    assert fp4dispatch.get_dispatcher()._states == {}  # nothing to compute: nothing probed or decided
    with pytest.raises(InvalidInputError, match=rf"^{op}: backend must be one of \[.*'reference'.*\]; got 'refrence'$"):
        fn(*args, backend="refrence")
    other = "triton:grouped" if op in ("fp4_mm", "w4a16_mm") else "triton:w4a16"
    with pytest.raises(InvalidInputError, match=rf"^{op}: backend '{other}' computes .* only; pass one of \["):
        fn(*args, backend=other)
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "garbage")
    fp4dispatch.set_dispatcher(None)
    # refused when the default dispatcher is made for the call, before anything else
    with pytest.raises(InvalidInputError, match=r"^FP4DISPATCH_BACKEND='garbage' names no backend; accepted names: "
                                                r"\[.*\]\. Fix the name or unset the variable$"):
        fn(*args)


@pytest.mark.parametrize("op", ["fp4_mm", "w4a16_mm", "fp4_grouped_mm", "w4a16_grouped_mm"])
def test_inputs_that_require_grad_give_results_without_autograd_history(op):
    fn, args = _op_call(op, 4, 40)
    args = tuple(t.clone().requires_grad_() if t.is_floating_point() and t.dtype != torch.float8_e4m3fn else t
                 for t in args)  # the bf16 activations of the W4A16 ops and the alpha of every op
    assert any(t.requires_grad for t in args)
    y = fn(*args, backend="reference")
    assert not y.requires_grad and y.grad_fn is None
    out = torch.empty(4, 40, dtype=torch.bfloat16)
    for _ in range(2):  # the second call reuses out, refused before if the first had given it a grad_fn
        assert fn(*args, out=out, backend="reference") is out
        assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, y)


@pytest.mark.parametrize("op", ["fp4_mm", "w4a16_mm", "fp4_grouped_mm", "w4a16_grouped_mm"])
def test_an_out_made_under_inference_mode_is_refused_outside_it(op):
    fn, args = _op_call(op, 4, 40)
    message = (rf"^{op}: out was made under torch.inference_mode\(\) and this call runs outside it, where torch lets "
               r"nothing write an inference tensor in place; got out.is_inference\(\)=True. Allocate out outside "
               r"inference_mode, or make the call inside it \(with torch.inference_mode\(\): ...\)$")
    kw = {"check_offs": False} if "grouped" in op else {}  # grouped repeats skip validation only without the check
    fn(*args, out=torch.empty(4, 40, dtype=torch.bfloat16), **kw)
    with torch.inference_mode():
        out = torch.empty(4, 40, dtype=torch.bfloat16)
        assert fn(*args, out=out, **kw) is out  # inside the mode it is an ordinary out
        inference_args = tuple(t.clone() for t in args)  # every tensor an inference tensor
        assert fn(*inference_args, out=out, **kw) is out
    for call_args in (args, inference_args):
        with pytest.raises(InvalidInputError, match=message):
            fn(*call_args, out=out, **kw)


def test_nan_scale_gives_nan_rows_and_columns_only():
    from fp4dispatch import swizzle_scales, unswizzle_scales

    a, b, sa, sb, alpha = _inputs(m=3, n=40, k=32)
    la, lb = unswizzle_scales(sa, 3, 2).clone(), unswizzle_scales(sb, 40, 2).clone()
    la.view(torch.uint8)[1, 0] = 0x7F  # e4m3 NaN in a's row 1
    lb.view(torch.uint8)[7, 1] = 0xFF  # and in b's row 7 (output column 7)
    out = fp4_mm(a, b, swizzle_scales(la), swizzle_scales(lb), alpha, out_dtype=torch.float32)
    nan = torch.isnan(out)
    assert nan[1].all() and nan[:, 7].all()
    nan[1], nan[:, 7] = False, False
    assert not nan.any()


def test_quantized_end_to_end_close_to_float_matmul():
    torch.manual_seed(3)
    x, w = torch.randn(8, 256), torch.randn(64, 256)
    qa, sa, ga = quantize_nvfp4(x)
    qb, sb, gb = quantize_nvfp4(w)
    out = fp4_mm(qa, qb, sa, sb, 1.0 / (ga * gb), out_dtype=torch.float32)
    rel = float((out - x @ w.T).norm() / (x @ w.T).norm())
    assert rel < 0.2  # NVFP4 quantization error of both operands; the GEMM itself is exact


# ----------------------------------------------------------------------------------------------------------------
# bad inputs: one case per class, each message pinned
# ----------------------------------------------------------------------------------------------------------------
A, B, SA, SB, ALPHA = _inputs(m=4, n=40, k=64)  # a [4,32], b [40,32], scales [128,4]


def _bad(**kw):
    args = dict(a=A, b=B, a_scale=SA, b_scale=SB, alpha=ALPHA)
    opts = {k: kw.pop(k) for k in list(kw) if k in ("out_dtype", "out", "scale_layout", "backend")}
    args.update(kw)
    return lambda: fp4_mm(args["a"], args["b"], args["a_scale"], args["b_scale"], args["alpha"], **opts)


BAD = [
    ("a-bf16", _bad(a=torch.randn(4, 64, dtype=torch.bfloat16)),
     r"fp4_mm: a must be packed NVFP4 data .*got dtype=torch.bfloat16.*quantize first with quantize_nvfp4"),
    ("b-float", _bad(b=torch.randn(40, 64)), r"fp4_mm: b must be packed NVFP4 data .*quantize first"),
    ("a-rank", _bad(a=A.reshape(-1)), r"fp4_mm: a must be 2-D \[M, K/2\] packed NVFP4; got a.shape=\(128,\)"),
    ("b-rank", _bad(b=B.reshape(2, 20, 32)), r"fp4_mm: b must be 2-D \[N, K/2\]"),
    ("k-mismatch", _bad(b=torch.zeros(40, 16, dtype=torch.uint8)),
     r"fp4_mm: b.shape\[1\] \(K/2\) must equal a.shape\[1\]=32: a and b disagree on K; got a.shape=\(4, 32\), b.shape=\(40, 16\)$"),
    ("b-transposed", _bad(b=B.T), r"b must be \[N, K/2\].*got b.shape=\(32, 40\).*the transposed view \[K/2, N\] = FlashInfer's b.T.*pass `b.T`"),
    ("k-not-16", _bad(a=torch.zeros(4, 4, dtype=torch.uint8), b=torch.zeros(40, 4, dtype=torch.uint8)),
     r"K=2\*a.shape\[1\]=8 must be a positive multiple of 16"),
    ("scale-dtype", _bad(a_scale=SA.float()), r"a_scale must hold float8_e4m3fn block scales .*got dtype=torch.float32"),
    ("scale-shape-swizzled", _bad(b_scale=torch.zeros(40, 3, dtype=torch.float8_e4m3fn)),
     r"b_scale with scale_layout='swizzled' must have shape \(128, 4\).*got b_scale.shape=\(40, 3\)"),
    ("scale-looks-linear", _bad(a_scale=torch.zeros(4, 4, dtype=torch.float8_e4m3fn)),
     r"a_scale with scale_layout='swizzled'.*It has the linear layout's shape: pass scale_layout='linear'"),
    ("scale-looks-swizzled", _bad(scale_layout="linear"),
     r"a_scale with scale_layout='linear' must have shape \(4, 4\).*It has the swizzled layout's shape"),
    ("alpha-bf16", _bad(alpha=torch.ones(1, dtype=torch.bfloat16)),
     r"^fp4_mm: alpha must be float32; got dtype=torch.bfloat16\. Compute 1/\(gs_a\*gs_b\) in float32 \(a bf16 "
     r"global scale gave silently wrong outputs in FlashInfer #3398\); fp4_mm never converts it for you$"),
    ("alpha-numel", _bad(alpha=torch.ones(2)), r"alpha must have exactly one element.*got alpha.shape=\(2,\)"),
    ("alpha-type", _bad(alpha="1.0"), r"alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got str"),
    ("a-noncontig", _bad(a=torch.zeros(32, 4, dtype=torch.uint8).T),
     r"a must be contiguous \[M, K/2\]; got strides \(1, 4\).*a.contiguous\(\)"),
    ("b-noncontig", _bad(b=torch.zeros(40, 64, dtype=torch.uint8)[:, ::2]), r"b must be contiguous \[N, K/2\]"),
    ("out-shape", _bad(out=torch.empty(4, 41, dtype=torch.bfloat16)),
     r"out must be a contiguous \[M, N\]=\(4, 40\) tensor of dtype torch.bfloat16.*got shape=\(4, 41\)"),
    ("out-dtype", _bad(out=torch.empty(4, 40, dtype=torch.float16)), r"out must be .*got shape=\(4, 40\), dtype=torch.float16"),
    ("out-dtype-unsupported", _bad(out_dtype=torch.int32), r"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32; got torch.int32"),
    ("scale-layout", _bad(scale_layout="blocked"), r"scale_layout must be one of \('swizzled', 'linear'\); got 'blocked'"),
    ("unknown-backend", _bad(backend="cutlass"), r"fp4_mm: backend must be one of .*'reference'.*got 'cutlass'"),
]


@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in BAD])
def test_bad_input_messages(call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()


def test_device_mismatch_messages():
    # Only a 'meta' device is available on a CPU box: it still exercises the device checks.
    with pytest.raises(InvalidInputError, match=r"a and b must be on the same device; got a.device=cpu, b.device=meta"):
        fp4_mm(A, B.to("meta"), SA, SB, ALPHA)
    with pytest.raises(InvalidInputError, match=r"b_scale must be on cpu like a; got b_scale.device=meta"):
        fp4_mm(A, B, SA, SB.to("meta"), ALPHA)
    with pytest.raises(InvalidInputError, match=r"alpha must be on cpu like a; got alpha.device=meta"):
        fp4_mm(A, B, SA, SB, ALPHA.to("meta"))
    with pytest.raises(InvalidInputError, match=r"out must be .* on cpu; got .*device=meta"):
        fp4_mm(A, B, SA, SB, ALPHA, out=torch.empty(4, 40, dtype=torch.bfloat16, device="meta"))


def test_errors_are_value_errors_and_public():
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(InvalidInputError, fp4dispatch.FP4DispatchError)
    assert issubclass(fp4dispatch.NoUsableBackendError, fp4dispatch.FP4DispatchError)
